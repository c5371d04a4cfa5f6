"""A small caption encoder for visar's own text-to-image models, trained jointly with them.

Word-level: the caption is lower-cased and split on spaces; words outside the vocabulary map to
<unk>. Output follows LlamaGen's t2i layout: `max_len` caption vectors, LEFT-padded, with a mask
that is False on the padding (LlamaGen's `emb_masks`). Two pre-norm transformer layers mix the
words, because LlamaGen gives condition positions zero RoPE: word order reaches the image tokens
only through the caption vectors themselves.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..errors import VisarError

PAD, UNK = "<pad>", "<unk>"


@dataclass(frozen=True)
class CaptionEncoderConfig:
    vocab: tuple[str, ...]
    max_len: int = 16
    dim: int = 64
    n_layer: int = 2
    n_head: int = 4

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, args: dict) -> CaptionEncoderConfig:
        return cls(**{**args, "vocab": tuple(args["vocab"])})


class CaptionEncoder(nn.Module):
    def __init__(self, config: CaptionEncoderConfig):
        super().__init__()
        if config.vocab[:2] != (PAD, UNK):
            raise VisarError(f"caption vocabulary must start with {PAD!r}, {UNK!r}")
        self.config = config
        self.word_index = {word: i for i, word in enumerate(config.vocab)}
        self.word_embedding = nn.Embedding(len(config.vocab), config.dim)
        self.position_embedding = nn.Parameter(torch.zeros(config.max_len, config.dim))
        layer = nn.TransformerEncoderLayer(
            config.dim, config.n_head, 4 * config.dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.layers = nn.TransformerEncoder(layer, config.n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(config.dim)
        self._warned_words: set[str] = set()  # each unknown word is named once per encoder
        self._warned_truncation = False

    def tokenize(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """prompts -> (word ids [B, max_len], mask [B, max_len]), left-padded.

        Words outside the vocabulary become <unk> and a prompt longer than `max_len` words keeps
        its first `max_len` (as LlamaGen truncates its T5 input); each is said once per encoder in
        a warning that names the words, never an error: the shapes world's vocabulary is small."""
        ids = torch.zeros(len(prompts), self.config.max_len, dtype=torch.long)
        unknown, truncated = [], 0
        for row, prompt in enumerate(prompts):
            words = prompt.lower().split()
            if not words:
                raise VisarError("empty prompt")
            if len(words) > self.config.max_len:
                truncated = max(truncated, len(words))
                words = words[: self.config.max_len]
            unknown += [w for w in words if w not in self.word_index and w not in unknown]
            unk = self.word_index[UNK]
            ids[row, -len(words) :] = torch.tensor([self.word_index.get(w, unk) for w in words])
        self._warn_once(unknown, truncated)
        return ids, ids != 0

    def _warn_once(self, unknown: list[str], truncated: int):
        new = [w for w in unknown if w not in self._warned_words]
        if new:
            self._warned_words.update(new)
            known = ", ".join(w for w in self.config.vocab[2:])
            warnings.warn(
                f"the caption encoder does not know {', '.join(map(repr, new))}: encoded as {UNK} "
                f"(its vocabulary: {known})",
                stacklevel=3,
            )
        if truncated and not self._warned_truncation:
            self._warned_truncation = True
            warnings.warn(
                f"a prompt of {truncated} words was cut to this encoder's first {self.config.max_len}", stacklevel=3
            )

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        """word ids [B, T], mask [B, T] -> caption vectors [B, T, dim] (zero on padding)."""
        h = self.word_embedding(ids) + self.position_embedding[: ids.shape[1]]
        h = self.layers(h, src_key_padding_mask=~mask)
        return self.norm(h) * mask[..., None]

    def encode_negative(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """Negative prompts, encoded as prompts are; an empty one has no words to encode (all padding would
        leave the unconditional branch nothing to attend to), so it is refused."""
        if any(not p.split() for p in prompts):
            raise VisarError(
                "an empty negative prompt cannot be encoded by this model's caption encoder (it has no words): give "
                "it some words, or leave negative_prompt=None for the model's own null caption"
            )
        return self.encode(prompts)

    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        device = self.position_embedding.device
        ids, mask = self.tokenize(prompts)
        ids, mask = ids.to(device), mask.to(device)
        with torch.no_grad():
            return self(ids, mask), mask
