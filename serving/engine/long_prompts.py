"""Weighted and long prompts on one text encoder, through compel's ``EmbeddingsProvider``: a prompt past the
encoder's window is encoded in windows of its length (split at the last sentence, phrase or word end that fits, each
window with its own start and end tokens, as compel's ``Compel`` splits them) and the windows' states joined along
the sequence; a weighted stretch's token states move away from the empty
prompt's (weight > 1) or towards the prompt without it (weight < 1), compel's weighting.

Prompts encoded together are padded to one length with the empty prompt's window, as compel pads them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Literal

import torch
from compel import EmbeddingsProvider, ReturnedEmbeddingsType, SplitLongTextMode

from serving.engine.emphasis import WeightedText

#: Which of the encoder's states condition the denoiser: the last (SD 1.x/2.x) or the one before it (SDXL, SD3).
HiddenStates = Literal["last", "penultimate"]
#: Runs the encoder calls made inside it with the request's LoRAs on that many rows.
LoRAScope = Callable[[int], AbstractContextManager]

_RETURNED = {"last": ReturnedEmbeddingsType.LAST_HIDDEN_STATES_NORMALIZED,
             "penultimate": ReturnedEmbeddingsType.PENULTIMATE_HIDDEN_STATES_NON_NORMALIZED}


class _ScopedEncoder:
    """The text encoder as compel calls it: every forward inside the request's LoRA scope, sized to its rows."""

    def __init__(self, encoder: torch.nn.Module, scope: LoRAScope) -> None:
        self._encoder, self._scope = encoder, scope

    @property
    def device(self) -> torch.device:
        return self._encoder.device

    @property
    def dtype(self) -> torch.dtype:
        return self._encoder.dtype

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs):
        with self._scope(input_ids.shape[0]):
            return self._encoder(input_ids, attention_mask=attention_mask, **kwargs)


def weighted_states(tokenizer, encoder: torch.nn.Module, prompts: Sequence[Sequence[WeightedText]], *,
                    states: HiddenStates, scope: LoRAScope, device: torch.device,
                    window: int | None = None, chunked: bool = True,
                    mask_padding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[len(prompts), S, D]: each prompt's weighted token states, in windows of ``window`` tokens (default: the
    tokenizer's) when ``chunked``, else cut at one window; and the empty prompt's window [1, window, D], what
    pads them. ``mask_padding``: the encoder takes an attention mask that hides padding (its config's
    ``use_attention_mask``)."""
    provider = EmbeddingsProvider(tokenizer, _ScopedEncoder(encoder, scope), truncate=not chunked,
                                  returned_embeddings_type=_RETURNED[states], device=device,
                                  padding_attention_mask_value=0 if mask_padding else 1, model_max_length=window,
                                  split_long_text_mode=SplitLongTextMode.SENTENCES)
    # an empty prompt (no stretches) as compel spells it: one empty fragment (compel cannot match none to tokens)
    prompts = [pieces or [WeightedText("")] for pieces in prompts]
    encoded = [provider.get_embeddings_for_weighted_prompt_fragments(
        text_batch=[[piece.text for piece in pieces]], fragment_weights_batch=[[piece.weight for piece in pieces]],
        device=device) for pieces in prompts]
    empty = provider.empty_z.to(encoded[0].dtype)
    return torch.cat(pad_to_length(encoded, empty, max(state.shape[1] for state in encoded))), empty


def pad_to_length(states: Sequence[torch.Tensor], empty: torch.Tensor, length: int) -> list[torch.Tensor]:
    """``states`` ([B, S_i, D] each, S_i a multiple of the window) padded with ``empty`` windows to ``length``."""
    return [torch.cat([state, *[empty.expand(state.shape[0], -1, -1)] * ((length - state.shape[1]) // empty.shape[1])],
                      dim=1) for state in states]


def same_length(first: tuple[torch.Tensor, torch.Tensor],
                second: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Two encoders' ``weighted_states`` of the same prompts, the shorter padded with its own empty windows (two
    tokenizers may split a prompt into different numbers of windows)."""
    length = max(first[0].shape[1], second[0].shape[1])
    return pad_to_length([first[0]], first[1], length)[0], pad_to_length([second[0]], second[1], length)[0]


def token_count(tokenizer, text: str) -> int:
    """Tokens of ``text`` with the start and end tokens, uncut."""
    return len(tokenizer(text, truncation=False).input_ids)
