"""A VAE decode split into two row bands, one per device, exact (patch parallelism in the manner of DistVAE).

Both bands run the latent-resolution stages whole (post-quant conv, ``conv_in``, the mid block with its attention:
a few percent of the decode). From the first up block on, each band computes only its own rows. At every
GroupNorm the bands swap their partial statistics (count, mean, M2 per group: Chan's parallel combination), and
at every 3x3 convolution each one pads its rows with the neighbour's edge row, so the result equals the whole
decode up to float rounding. A band is a generator: it yields what it sends its neighbour (``BandSync``) and is
sent the neighbour's. ``decode_with_peer`` runs the top band here while a ``BandPeer`` runs the bottom band on another
device (the CFG worker's: ``CFGWorker.band_peer``), the two computing each stretch between syncs at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from concurrent.futures import Executor, Future
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from diffusers.models.resnet import ResnetBlock2D
from diffusers.models.unets.unet_2d_blocks import UpDecoderBlock2D
from diffusers.models.upsampling import Upsample2D
from torch import nn

TOP, BOTTOM = 0, 1  # the two bands: the upper rows and the lower rows


class BandDecodeUnsupported(ValueError):
    """The VAE's decoder has a block the band decode does not know how to split."""


@dataclass(frozen=True)
class BandSync:
    """What a band sends its neighbour at a sync point: its edge row next to the neighbour (before normalisation)
    and, before a GroupNorm, its partial statistics per group."""

    edge: torch.Tensor  # [n, C, 1, W]
    count: int = 0
    mean: torch.Tensor | None = None  # [n, groups], float32
    m2: torch.Tensor | None = None  # [n, groups], float32: sum of squared deviations from ``mean``


    def to(self, device: torch.device) -> BandSync:
        return replace(self, edge=self.edge.to(device), mean=None if self.mean is None else self.mean.to(device),
                       m2=None if self.m2 is None else self.m2.to(device))


BandGenerator = Generator[BandSync, BandSync, torch.Tensor]
BandStep = BandSync | torch.Tensor  # a band's next sync, or its rows once it has finished


class BandPeer(ABC):
    """The bottom band of a decode, run elsewhere: it is sent the top band's syncs and answers its own."""

    @abstractmethod
    def send(self, sync: BandSync) -> None:
        """Hands the peer the top band's sync; returns at once."""

    @abstractmethod
    def receive(self) -> BandStep:
        """The peer's next step (its first needs no ``send`` before it)."""

    def close(self) -> None:  # noqa: B027 (a peer with nothing to release)
        """Releases the peer (also after a failure)."""


class GeneratorBandPeer(BandPeer):
    """A bottom band generator in this process, resumed on ``executor`` (a thread driving the peer's device) or
    inline when there is none; the syncs it is sent are moved to ``device`` first."""

    def __init__(self, band: BandGenerator, executor: Executor | None = None, device: torch.device | None = None):
        self._band, self._executor, self._device = band, executor, device
        self._next = self._run(next, band)

    def send(self, sync: BandSync) -> None:
        self._next = self._run(next_step, self._band, sync if self._device is None else sync.to(self._device))

    def receive(self) -> BandStep:
        return self._next.result()

    def _run(self, function: Callable[..., BandStep], *args: object) -> Future:
        if self._executor is not None:
            return self._executor.submit(function, *args)
        future: Future = Future()
        try:
            future.set_result(function(*args))
        except Exception as exc:
            future.set_exception(exc)
        return future


def check_band_decodable(vae: nn.Module) -> None:
    """Raises ``BandDecodeUnsupported`` unless every up-path block of ``vae.decoder`` is one the bands can split
    (the Stable Diffusion VAEs: ResNet blocks without time embedding, nearest-upsample convolutions, GroupNorm)."""
    decoder = vae.decoder
    if not isinstance(decoder.conv_norm_out, nn.GroupNorm) or not _is_same_conv(decoder.conv_out):
        raise BandDecodeUnsupported("the decoder's output head is not GroupNorm + a 3x3 convolution")
    for block in decoder.up_blocks:
        if not isinstance(block, UpDecoderBlock2D):
            raise BandDecodeUnsupported(f"up block {type(block).__name__} is not UpDecoderBlock2D")
        for resnet in block.resnets:
            if not (isinstance(resnet, ResnetBlock2D) and resnet.time_emb_proj is None and resnet.upsample is None
                    and resnet.downsample is None and isinstance(resnet.norm1, nn.GroupNorm)
                    and isinstance(resnet.norm2, nn.GroupNorm) and _is_same_conv(resnet.conv1)
                    and _is_same_conv(resnet.conv2)):
                raise BandDecodeUnsupported("a decoder ResNet block has a time embedding, resampling or another "
                                            "norm or convolution")
        for upsampler in block.upsamplers or ():
            if not (isinstance(upsampler, Upsample2D) and upsampler.use_conv and upsampler.interpolate
                    and not upsampler.use_conv_transpose and upsampler.norm is None
                    and _is_same_conv(upsampler.conv)):
                raise BandDecodeUnsupported("a decoder upsampler is not a nearest 2x upsample + 3x3 convolution")


def band_rows(latent_height: int, band: int) -> slice:
    """The latent rows of ``band`` (the top band takes the extra row of an odd height)."""
    middle = (latent_height + 1) // 2
    return slice(0, middle) if band == TOP else slice(middle, latent_height)


@torch.inference_mode()
def decode_band(vae: nn.Module, latents: torch.Tensor, band: int) -> BandGenerator:
    """``band``'s rows of ``vae.decode(latents)`` ([n, 3, 8 x its latent rows, W]); scaled latents as
    ``vae.decode`` takes them. Yields a ``BandSync`` at each sync point and must be sent the neighbour's."""
    if latents.shape[2] < 2:
        raise ValueError("a band decode needs a latent at least 2 rows high")
    decoder = vae.decoder
    if getattr(vae, "post_quant_conv", None) is not None:
        latents = vae.post_quant_conv(latents)
    sample = decoder.mid_block(decoder.conv_in(latents), None)[:, :, band_rows(latents.shape[2], band)]
    for block in decoder.up_blocks:
        for resnet in block.resnets:
            sample = yield from _resnet(resnet, sample, band)
        for upsampler in block.upsamplers or ():
            sample = yield from _upsample(upsampler, sample, band)
    return (yield from _norm_act_conv(decoder.conv_norm_out, decoder.conv_act, decoder.conv_out, sample, band))


def decode_with_peer(vae: nn.Module, latents: torch.Tensor, peer: BandPeer) -> torch.Tensor:
    """``vae.decode(latents)``: the top band here, the bottom band on ``peer``, each stretch between two syncs
    computed by both at once; the result on ``latents``' device. The peer is closed at the end, also on failure."""
    try:
        top = decode_band(vae, latents, TOP)
        mine, theirs = next(top), peer.receive().to(latents.device)
        while isinstance(mine, BandSync) and isinstance(theirs, BandSync):
            peer.send(mine)
            mine = next_step(top, theirs)
            theirs = peer.receive().to(latents.device)
        if not (isinstance(mine, torch.Tensor) and isinstance(theirs, torch.Tensor)):
            raise RuntimeError("the bands went out of step")
        return torch.cat([mine, theirs], dim=2)
    finally:
        peer.close()


def next_step(band: BandGenerator, received: BandSync) -> BandStep:
    """Resumes ``band`` with the neighbour's sync: its next sync, or its rows once it has finished."""
    try:
        return band.send(received)
    except StopIteration as finished:
        return finished.value


def _resnet(resnet: ResnetBlock2D, x: torch.Tensor, band: int) -> BandGenerator:
    hidden = yield from _norm_act_conv(resnet.norm1, resnet.nonlinearity, resnet.conv1, x, band)
    hidden = yield from _norm_act_conv(resnet.norm2, resnet.nonlinearity, resnet.conv2, hidden, band)
    shortcut = resnet.conv_shortcut(x) if resnet.conv_shortcut is not None else x
    return (shortcut + hidden) / resnet.output_scale_factor


def _norm_act_conv(norm: nn.GroupNorm, activation: nn.Module, conv: nn.Conv2d, x: torch.Tensor,
                   band: int) -> BandGenerator:
    """``conv(activation(norm(x)))`` on the band's rows, the norm's statistics and the conv's halo row taken from
    the neighbour."""
    count, mean, m2 = _partial_stats(x, norm.num_groups)
    neighbour = yield BandSync(_edge(x, band), count, mean, m2)
    mean, var = _combine(count, mean, m2, neighbour.count, neighbour.mean, neighbour.m2)

    def normalized(rows: torch.Tensor) -> torch.Tensor:
        return activation(_group_norm(rows, norm, mean, var))

    return _conv_with_halo(conv, normalized(x), normalized(neighbour.edge), band)


def _upsample(upsampler: Upsample2D, x: torch.Tensor, band: int) -> BandGenerator:
    neighbour = yield BandSync(_edge(x, band))
    up = F.interpolate(x, scale_factor=2.0, mode="nearest")
    halo = F.interpolate(neighbour.edge, scale_factor=2.0, mode="nearest")[:, :, :1]  # its two rows are equal
    return _conv_with_halo(upsampler.conv, up, halo, band)


def _conv_with_halo(conv: nn.Conv2d, rows: torch.Tensor, halo: torch.Tensor, band: int) -> torch.Tensor:
    """The 3x3 ``conv`` of the band's ``rows``: the neighbour's ``halo`` row on the inner side, zeros (the conv's
    own padding) on the image's edge."""
    zeros = torch.zeros_like(halo)
    padded = torch.cat([zeros, rows, halo] if band == TOP else [halo, rows, zeros], dim=2)
    return F.conv2d(padded, conv.weight, conv.bias, padding=(0, 1))


def _edge(x: torch.Tensor, band: int) -> torch.Tensor:
    """The band's row next to its neighbour."""
    return x[:, :, -1:] if band == TOP else x[:, :, :1]


def _partial_stats(x: torch.Tensor, groups: int) -> tuple[int, torch.Tensor, torch.Tensor]:
    values = x.float().reshape(x.shape[0], groups, -1)
    mean = values.mean(dim=2)
    return values.shape[2], mean, ((values - mean[:, :, None]) ** 2).sum(dim=2)


def _combine(count_a: int, mean_a: torch.Tensor, m2_a: torch.Tensor, count_b: int, mean_b: torch.Tensor,
             m2_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and biased variance of two parts from their counts, means and M2 (Chan et al.)."""
    total = count_a + count_b
    delta = mean_b - mean_a
    mean = mean_a + delta * (count_b / total)
    m2 = m2_a + m2_b + delta * delta * (count_a * count_b / total)
    return mean, m2 / total


def _group_norm(x: torch.Tensor, norm: nn.GroupNorm, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    n, channels = x.shape[:2]
    grouped = x.float().reshape(n, norm.num_groups, -1)
    normalized = ((grouped - mean[:, :, None]) * torch.rsqrt(var[:, :, None] + norm.eps)).reshape(x.shape)
    if norm.affine:
        shape = (1, channels, 1, 1)
        normalized = normalized * norm.weight.float().view(shape) + norm.bias.float().view(shape)
    return normalized.to(x.dtype)


def _is_same_conv(conv: nn.Module) -> bool:
    """A 3x3, stride-1, padding-1 convolution (output the size of its input)."""
    return (isinstance(conv, nn.Conv2d) and conv.kernel_size == (3, 3) and conv.stride == (1, 1)
            and conv.padding == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1
            and conv.padding_mode == "zeros")
