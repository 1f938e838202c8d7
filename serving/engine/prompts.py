"""Prompt encoders: a request's prompts to what the denoiser is conditioned on, per model family.

``CLIPPromptEncoder`` (Stable Diffusion 1.x/2.x) follows ``StableDiffusionPipeline.encode_prompt``;
``SDXLPromptEncoder`` follows ``StableDiffusionXLPipeline.encode_prompt`` and its added time ids;
``SD3PromptEncoder`` follows ``StableDiffusion3Pipeline.encode_prompt``. Each encodes the prompt and the negative
prompt in one batch, with the request's LoRAs on each CLIP text encoder they target.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer, T5EncoderModel, T5TokenizerFast

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

    @abstractmethod
    def encode(self, params: GenerationParams,
               loras: RequestLoRAs = ()) -> tuple[TextEmbeddings, TextEmbeddings | None]:
        """The prompt's embeddings and, with CFG, the negative prompt's, each repeated for the request's images,
        with ``loras`` on the text encoders they target."""

    def _texts(self, params: GenerationParams) -> list[str]:
        return [params.prompt, params.negative_prompt or ""] if params.uses_cfg else [params.prompt]

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
        texts = self._texts(params)
        mask = None
        if getattr(self.text_encoder.config, "use_attention_mask", False):
            mask = self.tokenizer(texts, padding="max_length", max_length=self.tokenizer.model_max_length,
                                  truncation=True, return_tensors="pt").attention_mask.to(self.device)
        with self._with_loras("text_encoder", loras, len(texts)):
            hidden = self.text_encoder(self._tokens(self.tokenizer, texts), attention_mask=mask)[0]
        hidden = hidden.to(self.dtype).repeat_interleave(params.n, dim=0)
        prompt = TextEmbeddings(hidden[:params.n])
        return prompt, (TextEmbeddings(hidden[params.n:]) if params.uses_cfg else None)


class SDXLPromptEncoder(PromptEncoder):
    """SDXL: both encoders' penultimate hidden states, concatenated; the second's pooled projection and the six
    size numbers (original size, crop corner 0 0, target size: the requested size) as the UNet's added inputs. An
    absent negative prompt conditions on zeros when ``force_zeros_for_empty_prompt`` (diffusers' default)."""

    def __init__(self, tokenizer: CLIPTokenizer, text_encoder: CLIPTextModel, tokenizer_2: CLIPTokenizer,
                 text_encoder_2: CLIPTextModelWithProjection, device: torch.device, dtype: torch.dtype, *,
                 force_zeros_for_empty_prompt: bool = True) -> None:
        super().__init__(tokenizer, text_encoder, device, dtype)
        self.tokenizer_2, self.text_encoder_2 = tokenizer_2, text_encoder_2
        self.force_zeros_for_empty_prompt = force_zeros_for_empty_prompt
        self._hooks["text_encoder_2"] = LoRAHooks(text_encoder_2)

    def encode(self, params: GenerationParams,
               loras: RequestLoRAs = ()) -> tuple[TextEmbeddings, TextEmbeddings | None]:
        zero_negative = params.uses_cfg and params.negative_prompt is None and self.force_zeros_for_empty_prompt
        texts = [params.prompt] if zero_negative else self._texts(params)
        first = self._clip("text_encoder", self.tokenizer, self.text_encoder, texts, loras)
        second = self._clip("text_encoder_2", self.tokenizer_2, self.text_encoder_2, texts, loras)
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


class SD3PromptEncoder(PromptEncoder):
    """SD3: both CLIP encoders' penultimate hidden states, concatenated and zero-padded to the T5 encoder's width,
    then the T5 encoder's last hidden states after them in the sequence; both CLIP pooled projections,
    concatenated, as the transformer's ``pooled_projections``. An absent negative prompt is the empty one."""

    #: T5 tokens per prompt: diffusers' default ``max_sequence_length`` for SD3
    max_sequence_length = 256

    def __init__(self, tokenizer: CLIPTokenizer, text_encoder: CLIPTextModelWithProjection,
                 tokenizer_2: CLIPTokenizer, text_encoder_2: CLIPTextModelWithProjection,
                 tokenizer_3: T5TokenizerFast, text_encoder_3: T5EncoderModel, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__(tokenizer, text_encoder, device, dtype)
        self.tokenizer_2, self.text_encoder_2 = tokenizer_2, text_encoder_2
        self.tokenizer_3, self.text_encoder_3 = tokenizer_3, text_encoder_3
        self._hooks["text_encoder_2"] = LoRAHooks(text_encoder_2)

    def encode(self, params: GenerationParams,
               loras: RequestLoRAs = ()) -> tuple[TextEmbeddings, TextEmbeddings | None]:
        texts = self._texts(params)
        first = self._clip("text_encoder", self.tokenizer, self.text_encoder, texts, loras)
        second = self._clip("text_encoder_2", self.tokenizer_2, self.text_encoder_2, texts, loras)
        t5 = self.text_encoder_3(self._tokens(self.tokenizer_3, texts, self.max_sequence_length))[0]
        clip = torch.cat([first.hidden_states[-2], second.hidden_states[-2]], dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        hidden = torch.cat([clip, t5], dim=-2).to(self.dtype).repeat_interleave(params.n, dim=0)
        pooled = torch.cat([first.text_embeds, second.text_embeds], dim=-1).to(self.dtype)
        pooled = pooled.repeat_interleave(params.n, dim=0)
        embeddings = [TextEmbeddings(hidden[i * params.n:(i + 1) * params.n],
                                     {"pooled_projections": pooled[i * params.n:(i + 1) * params.n]})
                      for i in range(len(texts))]
        return embeddings[0], (embeddings[1] if params.uses_cfg else None)
