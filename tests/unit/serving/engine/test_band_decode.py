"""The two-band VAE decode equals the whole decode, and each band computes only its own rows."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from diffusers import AutoencoderKL
from diffusers.models.upsampling import Upsample2D

from serving.engine.band_decode import (
    BOTTOM,
    TOP,
    BandDecodeUnsupported,
    BandPeer,
    GeneratorBandPeer,
    band_rows,
    check_band_decodable,
    decode_band,
    decode_with_peer,
)
from serving.presets import build_preset


def decode_in_two_bands(vae: AutoencoderKL, latents: torch.Tensor) -> torch.Tensor:
    """``vae.decode(latents)`` as two bands in this thread."""
    return decode_with_peer(vae, latents, GeneratorBandPeer(decode_band(vae, latents, BOTTOM)))


def _vae(seed: int = 0) -> AutoencoderKL:
    """Three up blocks whose channels fall (a shortcut convolution in each first ResNet), two upsamplers."""
    torch.manual_seed(seed)
    vae = AutoencoderKL(block_out_channels=(16, 32, 32), down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, layers_per_block=1, latent_channels=4,
                        norm_num_groups=8).eval()
    for parameter in vae.parameters():  # away from initialisation: biases and norm affines matter too
        parameter.data.add_(torch.randn_like(parameter) * 0.05)
    return vae


@pytest.mark.parametrize("height, width", [(8, 8), (7, 5), (2, 3)])
def test_two_bands_decode_what_the_whole_vae_decodes(height, width):
    vae = _vae()
    latents = torch.randn(2, 4, height, width, generator=torch.Generator().manual_seed(height))
    with torch.inference_mode():
        whole = vae.decode(latents, return_dict=False)[0]
    banded = decode_in_two_bands(vae, latents)
    assert banded.shape == whole.shape
    torch.testing.assert_close(banded, whole, rtol=1e-4, atol=1e-5)


def test_the_default_preset_vae_decodes_in_two_bands():
    vae = build_preset("tiny").vae.eval()
    check_band_decodable(vae)
    latents = torch.randn(1, vae.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = vae.decode(latents, return_dict=False)[0]
    torch.testing.assert_close(decode_in_two_bands(vae, latents), whole, rtol=1e-4, atol=1e-5)


def test_a_band_returns_only_its_rows_after_one_sync_per_norm_and_upsampler():
    vae = _vae()
    latents = torch.randn(1, 4, 7, 4, generator=torch.Generator().manual_seed(2))
    norms = sum(isinstance(module, torch.nn.GroupNorm) for module in vae.decoder.up_blocks.modules()) + 1
    upsamplers = sum(isinstance(module, Upsample2D) for module in vae.decoder.modules())
    scale = 2 ** upsamplers
    for band in (TOP, BOTTOM):
        generator, syncs = decode_band(vae, latents, band), 0
        sync = next(generator)
        try:
            while True:
                syncs += 1
                sync = generator.send(sync)  # its own rows as the neighbour's: shapes hold, values do not matter
        except StopIteration as finished:
            rows = finished.value
        assert syncs == norms + upsamplers
        latent_rows = band_rows(7, band)
        assert rows.shape == (1, 3, (latent_rows.stop - latent_rows.start) * scale, 4 * scale)


def test_a_decoder_the_bands_cannot_split_is_refused():
    vae = _vae()
    check_band_decodable(vae)
    vae.decoder.up_blocks[0].upsamplers[0] = Upsample2D(32, use_conv_transpose=True, out_channels=32)
    with pytest.raises(BandDecodeUnsupported, match="upsampler"):
        check_band_decodable(vae)
    with pytest.raises(ValueError, match="2 rows"):
        next(decode_band(_vae(), torch.zeros(1, 4, 1, 4), TOP))


def _on_threads(band, names: list[str]):
    """``band``, recording the thread of each resume."""
    names.append(threading.current_thread().name)
    sync = next(band)
    while True:
        received = yield sync
        names.append(threading.current_thread().name)
        try:
            sync = band.send(received)
        except StopIteration as finished:
            return finished.value


def test_a_peer_on_its_own_thread_runs_the_bottom_band_there():
    vae = _vae()
    latents = torch.randn(1, 4, 6, 5, generator=torch.Generator().manual_seed(3))
    names: list[str] = []
    with ThreadPoolExecutor(1, thread_name_prefix="device-1") as pool:
        peer = GeneratorBandPeer(_on_threads(decode_band(vae, latents, BOTTOM), names), pool)
        banded = decode_with_peer(vae, latents, peer)
    with torch.inference_mode():
        torch.testing.assert_close(banded, vae.decode(latents, return_dict=False)[0], rtol=1e-4, atol=1e-5)
    assert len(names) > 1 and set(names) == {"device-1_0"}


class _DyingPeer(BandPeer):
    def __init__(self, inner: BandPeer, answers: int) -> None:
        self.inner, self.answers, self.closed = inner, answers, False

    def send(self, sync) -> None:
        self.inner.send(sync)

    def receive(self):
        if self.answers == 0:
            raise ConnectionError("peer lost")
        self.answers -= 1
        return self.inner.receive()

    def close(self) -> None:
        self.closed = True


def test_a_peer_lost_mid_decode_raises_and_is_closed():
    vae = _vae()
    latents = torch.randn(1, 4, 4, 4)
    peer = _DyingPeer(GeneratorBandPeer(decode_band(vae, latents, BOTTOM)), answers=3)
    with pytest.raises(ConnectionError):
        decode_with_peer(vae, latents, peer)
    assert peer.closed
