"""Same seed, same bytes: tokenizers, component inits, the VAE fit, and (slow) the whole build."""

from __future__ import annotations

import hashlib

import pytest


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _state_hash(module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def test_tokenizer_files_are_deterministic(tmp_path):
    from miles.models.tiny.tokenizers import save_tokenizers

    ids_a = save_tokenizers(tmp_path / "a")
    ids_b = save_tokenizers(tmp_path / "b")
    assert ids_a == ids_b
    files_a, files_b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert files_a and files_a == files_b


def test_component_inits_are_seeded():
    from miles.builtin.tiny import components as C
    from miles.builtin.tiny.sd3 import make_transformer

    tok = {
        "clip_vocab_size": 638,
        "clip_bos_id": 636,
        "clip_eos_id": 637,
        "clip_pad_id": 637,
        "t5_vocab_size": 240,
        "t5_pad_id": 0,
        "t5_eos_id": 1,
    }
    assert _state_hash(make_transformer(0)) == _state_hash(make_transformer(0))
    assert _state_hash(make_transformer(0)) != _state_hash(make_transformer(1))
    te = _state_hash(C.make_clip_text_encoder(0, "text_encoder", tok))
    assert te == _state_hash(C.make_clip_text_encoder(0, "text_encoder", tok))
    assert te != _state_hash(C.make_clip_text_encoder(0, "text_encoder_2", tok))
    assert _state_hash(C.make_t5_encoder(0, tok)) == _state_hash(C.make_t5_encoder(0, tok))


@pytest.mark.slow  # over a second: not in the fast tier
def test_vae_fit_is_deterministic(digits_split):
    from miles.builtin.tiny import components as C
    from miles.builtin.tiny.vae_fit import digits_to_vae_input, fit_vae

    images = digits_to_vae_input(digits_split.train_x[:32])
    hashes, losses = [], []
    for _ in range(2):
        vae = C.make_vae(0)
        losses.append(fit_vae(vae, images, steps=3, batch_size=4, seed=0))
        hashes.append(_state_hash(vae))
    assert hashes[0] == hashes[1] and losses[0] == losses[1]


@pytest.mark.slow  # the session's tiny-sd3 build (a minute or two cold): not in the fast tier
def test_built_transformer_is_the_seeded_init(tiny_sd3_dir):
    from safetensors.torch import load_file

    from miles.builtin.tiny.sd3 import make_transformer

    saved = load_file(tiny_sd3_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    init = make_transformer(0).state_dict()
    assert saved.keys() == init.keys()
    assert all(bool((saved[k] == init[k]).all()) for k in saved)


@pytest.mark.slow
@pytest.mark.extended  # ~40 s; the seeded inits, tokenizers and VAE fit are checked above in the default run
def test_full_rebuild_is_byte_identical(tiny_sd3_dir, tmp_path):
    from miles.builtin.tiny.sd3 import build_tiny_sd3

    build_tiny_sd3(tmp_path / "again", seed=0, progress=False)
    ours, theirs = _files(tmp_path / "again"), _files(tiny_sd3_dir)
    ours.pop("miles_tiny_sd3.json")  # holds timings
    theirs.pop("miles_tiny_sd3.json")
    assert ours.keys() == theirs.keys()
    different = [k for k in ours if ours[k] != theirs[k]]
    assert not different, different
