"""Model families, one file each, and the interfaces the decoding methods see (`base`).

`llamagen`: raster AR (LlamaGen GPT, c2i and t2i); `text`: visar's caption encoder.
"""
