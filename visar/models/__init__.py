"""Model families, one file each. `llamagen`: raster AR (LlamaGen GPT, c2i and t2i)."""
