"""Prompt encoders: a request's prompts to what the denoiser is conditioned on, per model family.

``CLIPPromptEncoder`` (Stable Diffusion 1.x/2.x) follows ``StableDiffusionPipeline.encode_prompt``;
``SDXLPromptEncoder`` follows ``StableDiffusionXLPipeline.encode_prompt`` and its added time ids;
``SD3PromptEncoder`` follows ``StableDiffusion3Pipeline.encode_prompt``; ``FluxPromptEncoder`` follows
``FluxPipeline.encode_prompt``. Each encodes the prompt and the negative
prompt in one batch, with the request's LoRAs on each CLIP text encoder they target.

A prompt with emphasis (``serving.engine.emphasis``), or one past a CLIP encoder's window, is encoded window by
window and weighted as compel does (``serving.engine.long_prompts``), the negative prompt padded to its length; any
other prompt is encoded as diffusers' pipelines encode it. T5 encoders keep their one window of
``max_sequence_length`` tokens (diffusers' and compel's rule), weighted too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

from serving.engine.emphasis import WeightedText, is_plain, joined_text, parse_emphasis
from serving.engine.long_prompts import same_length, token_count, weighted_states
from serving.engine.request import TextEmbeddings
from serving.engine.types import GenerationParams
from serving.lora.apply import LoRAHooks, plan_lora_rows
from serving.lora.weights import LoRAWeights
from serving.presets import DiffusionComponents

#: A request's LoRAs on this device, with the strength each is applied at.
RequestLoRAs = Sequence[tuple[LoRAWeights, float]]


class PromptEncoder(ABC):
    """A model family's text encoders on one device."""

    def __init__(self, tokenizer: CLIPTokenizer, text_encoder: CLIPTextModel, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.tokenizer, self.text_encoder = tokenizer, text_encoder
        self.device, self.dtype = device, dtype
        self._hooks = {"text_encoder": LoRAHooks(text_encoder)}

    @property
    def usual_length(self) -> int:
        """Text tokens a prompt within the encoders' windows conditions on (a longer one: more windows)."""
        return self.tokenizer.model_max_length

    @abstractmethod
    def encode(self, params: GenerationParams,
               loras: RequestLoRAs = ()) -> tuple[TextEmbeddings, TextEmbeddings | None]:
        """The prompt's embeddings and, with CFG, the negative prompt's, each repeated for the request's images,
        with ``loras`` on the text encoders they target."""

    def _prompts(self, params: GenerationParams) -> list[list[WeightedText]]:
        """The prompt and, with CFG, the negative prompt, as weighted stretches (``plain`` syntax: one stretch)."""
        texts = [params.prompt, params.negative_prompt or ""] if params.uses_cfg else [params.prompt]
        if params.prompt_syntax == "plain":
            return [[WeightedText(text)] if text else [] for text in texts]
        return [parse_emphasis(text) for text in texts]

    @staticmethod
    def _needs_weighting(prompts: list[list[WeightedText]], *tokenizers: CLIPTokenizer) -> bool:
        """Whether any prompt has emphasis or runs past a CLIP window: the weighted, windowed encoding."""
        return not all(is_plain(pieces) for pieces in prompts) or any(
            token_count(tokenizer, joined_text(pieces)) > tokenizer.model_max_length
            for pieces in prompts for tokenizer in tokenizers)

    def _scope(self, component: str, loras: RequestLoRAs) -> Callable[[int], AbstractContextManager]:
        """What runs one of ``component``'s forwards with ``loras`` on its rows."""
        return lambda rows: self._with_loras(component, loras, rows)

    def _tokens(self, tokenizer: CLIPTokenizer | T5TokenizerFast, texts: list[str],
                max_length: int | None = None) -> torch.Tensor:
        return tokenizer(texts, padding="max_length", max_length=max_length or tokenizer.model_max_length,
                         truncation=True, return_tensors="pt").input_ids.to(self.device)

    def _clip(self, component: str, tokenizer: CLIPTokenizer, encoder: CLIPTextModel, texts: list[str],
              loras: RequestLoRAs):
        """A CLIP encoder's output on ``texts``, hidden states included, with ``loras`` on it."""
        with self._with_loras(component, loras, len(texts)):
            return encoder(self._tokens(tokenizer, texts), output_hidden_states=True)

    @contextmanager
    def _with_loras(self, component: str, loras: RequestLoRAs, rows: int):
        """``loras``' layers for ``component`` on every one of ``rows`` rows of the forwards run in the block."""
        hooks = self._hooks[component]
        pairs = [(getattr(weights, component), scale) for weights, scale in loras if getattr(weights, component)]
        for layers, _ in pairs:
            hooks.ensure_hooks(layers)
        with hooks.active(plan_lora_rows([pairs] * rows, self.device)):
            yield


def prompt_encoder(components: DiffusionComponents, device: torch.device, dtype: torch.dtype) -> PromptEncoder:
    """The prompt encoder of ``components``' family (modules already on ``device``)."""
    if components.family == "flux":
        assert components.text_encoder_3 is not None and components.tokenizer_3 is not None
        return FluxPromptEncoder(components.tokenizer, components.text_encoder, components.tokenizer_3,
                                 components.text_encoder_3, device, dtype)
    if components.family == "sd3":
        assert components.text_encoder_2 is not None and components.tokenizer_2 is not None
        assert components.text_encoder_3 is not None and components.tokenizer_3 is not None
        return SD3PromptEncoder(components.tokenizer, components.text_encoder, components.tokenizer_2,
                                components.text_encoder_2, components.tokenizer_3, components.text_encoder_3,
                                device, dtype)
    if components.family == "sdxl":
        assert components.text_encoder_2 is not None and components.tokenizer_2 is not None
        return SDXLPromptEncoder(components.tokenizer, components.text_encoder, components.tokenizer_2,
                                 components.text_encoder_2, device, dtype,
                                 force_zeros_for_empty_prompt=components.force_zeros_for_empty_prompt)
    return CLIPPromptEncoder(components.tokenizer, components.text_encoder, device, dtype)


class CLIPPromptEncoder(PromptEncoder):
    """One CLIP text encoder's last hidden states (Stable Diffusion 1.x/2.x)."""

    def encode(self, params: GenerationParams,
               loras: RequestLoRAs = ()) -> tuple[TextEmbeddings, TextEmbeddings | None]:
        prompts = self._prompts(params)
        masked = getattr(self.text_encoder.config, "use_attention_mask", False)
        if self._needs_weighting(prompts, self.tokenizer):
            hidden, _ = weighted_states(self.tokenizer, self.text_encoder, prompts, states="last",
                                        scope=self._scope("text_encoder", loras), device=self.device,
                                        mask_padding=masked)
        else:
            texts = [joined_text(pieces) for pieces in prompts]
            mask = None
            if masked:
                mask = self.tokenizer(texts, padding="max_length", max_length=self.tokenizer.model_max_length,
                                      truncation=True, return_tensors="pt").attention_mask.to(self.device)
            with self._with_loras("text_encoder", loras, len(texts)):
                hidden = self.text_encoder(self._tokens(self.tokenizer, texts), attention_mask=mask)[0]
        hidden = hidden.to(self.dtype).repeat_interleave(params.n, dim=0)
        prompt = TextEmbeddings(hidden[:params.n])
        return prompt, (TextEmbeddings(hidden[params.n:]) if params.uses_cfg else None)


class _TwoCLIPPromptEncoder(PromptEncoder):
    """A family with a second CLIP encoder beside the first (SDXL, SD3)."""

    def __init__(self, tokenizer: CLIPTokenizer, text_encoder: CLIPTextModel, tokenizer_2: CLIPTokenizer,
                 text_encoder_2: CLIPTextModelWithProjection, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(tokenizer, text_encoder, device, dtype)
        self.tokenizer_2, self.text_encoder_2 = tokenizer_2, text_encoder_2
        self._hooks["text_encoder_2"] = LoRAHooks(text_encoder_2)

    def _weighted_clip_states(self, prompts: list[list[WeightedText]],
                              loras: RequestLoRAs) -> tuple[torch.Tensor, torch.Tensor]:
        """Both encoders' penultimate states of ``prompts``, weighted and windowed, of one length."""
        return same_length(*(weighted_states(tokenizer, encoder, prompts, states="penultimate",
                                             scope=self._scope(component, loras), device=self.device)
                             for component, tokenizer, encoder in (
                                 ("text_encoder", self.tokenizer, self.text_encoder),
                                 ("text_encoder_2", self.tokenizer_2, self.text_encoder_2))))


class SDXLPromptEncoder(_TwoCLIPPromptEncoder):
    """SDXL: both encoders' penultimate hidden states, concatenated; the second's pooled projection and the six
    size numbers (original size, crop corner 0 0, target size: the requested size) as the UNet's added inputs. An
    absent negative prompt conditions on zeros when ``force_zeros_for_empty_prompt`` (diffusers' default)."""

    def __init__(self, tokenizer: CLIPTokenizer, text_encoder: CLIPTextModel, tokenizer_2: CLIPTokenizer,
                 text_encoder_2: CLIPTextModelWithProjection, device: torch.device, dtype: torch.dtype, *,
                 force_zeros_for_empty_prompt: bool = True) -> None:
        super().__init__(tokenizer, text_encoder, tokenizer_2, text_encoder_2, device, dtype)
        self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt

    def encode(self, params: GenerationParams,
               loras: RequestLoRAs = ()) -> tuple[TextEmbeddings, TextEmbeddings | None]:
        zero_negative = params.uses_cfg and params.negative_prompt is None and self.force_zeros_for_empty_prompt
        prompts = self._prompts(params)[:1] if zero_negative else self._prompts(params)
        texts = [joined_text(pieces) for pieces in prompts]
        second = self._clip("text_encoder_2", self.tokenizer_2, self.text_encoder_2, texts, loras)
        if self._needs_weighting(prompts, self.tokenizer, self.tokenizer_2):
            hidden = torch.cat(self._weighted_clip_states(prompts, loras), dim=-1).to(self.dtype)
        else:
            first = self._clip("text_encoder", self.tokenizer, self.text_encoder, texts, loras)
            hidden = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1).to(self.dtype)
        pooled = second.text_embeds.to(self.dtype)
        time_ids = torch.tensor([[params.height, params.width, 0, 0, params.height, params.width]],
                                dtype=self.dtype, device=self.device)
        embeddings = [TextEmbeddings(hidden[i:i + 1].repeat_interleave(params.n, dim=0),
                                     {"text_embeds": pooled[i:i + 1].repeat_interleave(params.n, dim=0),
                                      "time_ids": time_ids.repeat(params.n, 1)})
                      for i in range(len(texts))]
        if zero_negative:
            prompt = embeddings[0]
            embeddings.append(TextEmbeddings(torch.zeros_like(prompt.hidden),
                                             {"text_embeds": torch.zeros_like(prompt.added["text_embeds"]),
                                              "time_ids": prompt.added["time_ids"]}))
        return embeddings[0], (embeddings[1] if params.uses_cfg else None)


class SD3PromptEncoder(_TwoCLIPPromptEncoder):
    """SD3: both CLIP encoders' penultimate hidden states, concatenated and zero-padded to the T5 encoder's width,
    then the T5 encoder's last hidden states after them in the sequence; both CLIP pooled projections,
    concatenated, as the transformer's ``pooled_projections``. An absent negative prompt is the empty one."""

    #: T5 tokens per prompt: diffusers' default ``max_sequence_length`` for SD3
    max_sequence_length = 256

    def __init__(self, tokenizer: CLIPTokenizer, text_encoder: CLIPTextModelWithProjection,
                 tokenizer_2: CLIPTokenizer, text_encoder_2: CLIPTextModelWithProjection,
                 tokenizer_3: T5TokenizerFast, text_encoder_3: T5EncoderModel, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__(tokenizer, text_encoder, tokenizer_2, text_encoder_2, device, dtype)
        self.tokenizer_3, self.text_encoder_3 = tokenizer_3, text_encoder_3

    @property
    def usual_length(self) -> int:
        return self.tokenizer.model_max_length + self.max_sequence_length

    def encode(self, params: GenerationParams,
               loras: RequestLoRAs = ()) -> tuple[TextEmbeddings, TextEmbeddings | None]:
        prompts = self._prompts(params)
        texts = [joined_text(pieces) for pieces in prompts]
        first = self._clip("text_encoder", self.tokenizer, self.text_encoder, texts, loras)
        second = self._clip("text_encoder_2", self.tokenizer_2, self.text_encoder_2, texts, loras)
        if self._needs_weighting(prompts, self.tokenizer, self.tokenizer_2):
            clip = torch.cat(self._weighted_clip_states(prompts, loras), dim=-1)
            t5, _ = weighted_states(self.tokenizer_3, self.text_encoder_3, prompts, states="last",
                                    scope=lambda rows: nullcontext(), device=self.device,
                                    window=self.max_sequence_length, chunked=False)
        else:
            clip = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)
            t5 = self.text_encoder_3(self._tokens(self.tokenizer_3, texts, self.max_sequence_length))[0]
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        hidden = torch.cat([clip, t5], dim=-2).to(self.dtype).repeat_interleave(params.n, dim=0)
        pooled = torch.cat([first.text_embeds, second.text_embeds], dim=-1).to(self.dtype)
        pooled = pooled.repeat_interleave(params.n, dim=0)
        embeddings = [TextEmbeddings(hidden[i * params.n:(i + 1) * params.n],
                                     {"pooled_projections": pooled[i * params.n:(i + 1) * params.n]})
                      for i in range(len(texts))]
        return embeddings[0], (embeddings[1] if params.uses_cfg else None)


class FluxPromptEncoder(PromptEncoder):
    """Flux: the CLIP encoder's pooled output as the transformer's ``pooled_projections`` and the T5 encoder's last
    hidden states as its context; each image's ``guidance`` scale beside them (what a guidance embedding takes:
    [dev]'s transformer, a ControlNet with one).
    The negative prompt (true CFG only) is encoded the same way. Weighted stretches weigh the T5 states, as compel
    does; the pooled output is the unweighted text's."""

    #: T5 tokens per prompt: diffusers' default ``max_sequence_length`` for Flux
    max_sequence_length = 512

    def __init__(self, tokenizer: CLIPTokenizer, text_encoder: CLIPTextModel, tokenizer_3: T5TokenizerFast,
                 text_encoder_3: T5EncoderModel, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__(tokenizer, text_encoder, device, dtype)
        self.tokenizer_3, self.text_encoder_3 = tokenizer_3, text_encoder_3

    @property
    def usual_length(self) -> int:
        return self.max_sequence_length

    def encode(self, params: GenerationParams,
               loras: RequestLoRAs = ()) -> tuple[TextEmbeddings, TextEmbeddings | None]:
        prompts = self._prompts(params)
        texts = [joined_text(pieces) for pieces in prompts]
        with self._with_loras("text_encoder", loras, len(texts)):
            pooled = self.text_encoder(self._tokens(self.tokenizer, texts), output_hidden_states=False).pooler_output
        if all(is_plain(pieces) for pieces in prompts):
            hidden = self.text_encoder_3(self._tokens(self.tokenizer_3, texts, self.max_sequence_length),
                                         output_hidden_states=False)[0]
        else:
            hidden, _ = weighted_states(self.tokenizer_3, self.text_encoder_3, prompts, states="last",
                                        scope=lambda rows: nullcontext(), device=self.device,
                                        window=self.max_sequence_length, chunked=False)
        hidden, pooled = hidden.to(self.dtype), pooled.to(self.dtype)
        guidance = torch.full((params.n,), params.guidance_scale, dtype=torch.float32, device=self.device)
        embeddings = [TextEmbeddings(hidden[i:i + 1].repeat_interleave(params.n, dim=0),
                                     {"pooled_projections": pooled[i:i + 1].repeat_interleave(params.n, dim=0),
                                      "guidance": guidance})
                      for i in range(len(texts))]
        return embeddings[0], (embeddings[1] if params.uses_cfg else None)
