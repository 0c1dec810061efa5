"""ONNX Runtime GenAI folders in and out (`normpass/genai.py`), and greedy generation token for token: fold,
rotate and slice at ratio 0 generate what the original generates, in onnxruntime-genai (builder folders) and in
a plain ONNX Runtime decode loop (torch.onnx with-past exports)."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest

from normpass import SliceOptions, SlicePass, genai, io, rotate_onnx
from normpass.cli.main import main
from normpass.models import genai as seeded

STEPS = 8


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def listing(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture
def phi(genai_folder, tmp_path):
    """A copy of the seeded Phi folder with an extra file and a subfolder the builder did not write."""
    folder = tmp_path / "phi"
    shutil.copytree(genai_folder("phi"), folder)
    (folder / "README.txt").write_text("a file the user keeps beside the model\n")
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_text("and one in a subfolder\n")
    return folder


def test_a_rotated_folder_carries_every_file_and_generates_the_same_tokens(phi, capsys, tmp_path):
    before = listing(phi)
    out = tmp_path / "rotated"
    code, stdout, err = cli(capsys, "rotate", phi, "-o", out)
    assert code == 0 and f"wrote {out}" in stdout, err
    assert listing(phi) == before  # the input is never modified
    written = listing(out)
    assert set(written) == set(before)
    for name in ("genai_config.json", "tokenizer.json", "tokenizer_config.json", "README.txt"):
        assert written[name] == before[name], name  # config unchanged: the rotation changes nothing it says
    assert written["model.onnx"] != before["model.onnx"] and "model.onnx.data" in written
    assert (out / "extra" / "notes.txt").read_text() == "and one in a subfolder\n"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".normpass-")]  # no temporary folder left
    for prompt in seeded.prompt_ids(phi / "tokenizer.json"):
        assert seeded.greedy_genai(out, prompt, STEPS) == seeded.greedy_genai(phi, prompt, STEPS)


@pytest.mark.parametrize(("family", "verb"), [("phi", "fold"), ("llama", "rotate"), ("llama", "slice")])
def test_exact_rewrites_of_a_folder_generate_the_same_tokens(genai_folder, capsys, tmp_path, family, verb):
    folder = genai_folder(family)
    out = tmp_path / verb
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(seeded.prompts() * 4))
    extra = ["--ratio", "0", "--calib", calib] if verb == "slice" else []  # text: the folder's own tokenizer
    code, _, err = cli(capsys, verb, folder, "-o", out, *extra)
    assert code == 0, err
    assert listing(out)["genai_config.json"] == listing(folder)["genai_config.json"]
    prompts = seeded.prompt_ids(folder / "tokenizer.json")
    generated = [seeded.greedy_genai(out, prompt, STEPS) for prompt in prompts]
    assert generated == [seeded.greedy_genai(folder, prompt, STEPS) for prompt in prompts]
    assert len({tuple(g[len(p) :]) for g, p in zip(generated, prompts, strict=True)}) > 1  # prompts matter


def test_a_sliced_folder_says_its_width_and_generates(genai_folder, capsys, tmp_path):
    folder = genai_folder("llama")
    out = tmp_path / "sliced"
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(seeded.prompts() * 6))
    code, stdout, err = cli(capsys, "slice", folder, "-o", out, "--ratio", "0.25", "--round-to", "8", "--calib", calib)
    assert code == 0 and "64 → 48" in stdout, err
    config, original = (json.loads((f / "genai_config.json").read_text()) for f in (out, folder))
    assert config["model"]["decoder"].pop("hidden_size") == 48
    assert original["model"]["decoder"].pop("hidden_size") == 64
    assert config == original  # nothing else changes
    prompt = seeded.prompt_ids(folder / "tokenizer.json")[0]
    assert len(seeded.greedy_genai(out, prompt, STEPS)) == len(prompt) + STEPS


def test_a_folder_sliced_with_its_head_whole_says_the_width_its_head_reads(genai_folder, capsys, tmp_path):
    """`--head full`: the layers run 48 wide, the final norm and the head read 64 (the width of the hidden states
    GenAI would take out of the decoder), so genai_config.json stays as it was."""
    folder = genai_folder("llama")
    out = tmp_path / "sliced"
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(seeded.prompts() * 6))
    argv = ["slice", folder, "-o", out, "--ratio", "0.25", "--round-to", "8", "--head", "full", "--calib", calib]
    code, stdout, err = cli(capsys, *argv)
    assert code == 0 and "64 → 48" in stdout, err
    assert listing(out)["genai_config.json"] == listing(folder)["genai_config.json"]
    prompt = seeded.prompt_ids(folder / "tokenizer.json")[0]
    assert len(seeded.greedy_genai(out, prompt, STEPS)) == len(prompt) + STEPS


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_qwen3_and_gemma2_folders_slice(genai_folder, capsys, tmp_path, family):
    """Qwen-3 (per-head q/k norms between GroupQueryAttention and its projection) and Gemma-2 (a sliding-window
    cache beside the past) calibrate on text: Qwen-3's residual stream is sliced, Gemma-2's is refused for its
    sandwich norms (exit 0, nothing cut, the reason said); at ratio 0 both generate the original's tokens."""
    folder = genai_folder(family)
    calib, holdout = tmp_path / "calib.txt", tmp_path / "holdout.txt"
    calib.write_text("\n".join(seeded.prompts() * 6))
    holdout.write_text("\n".join(f"{p} and then some more" for p in seeded.prompts() * 2))
    sliced = "1 of 5 residual streams sliced" if family == "qwen3" else "0 of 1 residual streams sliced"
    code, stdout, err = cli(capsys, "slice", folder, "-o", tmp_path / "exact", "--ratio", "0", "--calib", calib)
    assert code == 0 and sliced in stdout, err
    prompts = seeded.prompt_ids(folder / "tokenizer.json")
    generated = [seeded.greedy_genai(tmp_path / "exact", prompt, STEPS) for prompt in prompts]
    assert generated == [seeded.greedy_genai(folder, prompt, STEPS) for prompt in prompts]
    out = tmp_path / "cut"
    argv = ["slice", folder, "-o", out, "--ratio", "0.25", "--calib", calib, "--holdout", holdout]
    code, stdout, err = cli(capsys, *argv)
    assert code == 0 and sliced in stdout, err
    config = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
    if family == "qwen3":
        assert "64 → 48" in stdout and config["hidden_size"] == 48
        assert len(seeded.greedy_genai(out, prompts[0], STEPS)) == len(prompts[0]) + STEPS
    else:
        assert "with its own γ: a norm after a block (Gemma-2's sandwich norms)" in stdout
        assert listing(out)["genai_config.json"] == listing(folder)["genai_config.json"]


def test_folder_outputs_and_inputs_that_are_refused(genai_folder, capsys, tmp_path):
    folder = genai_folder("llama")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    cases = [
        (["rotate", folder, "-o", taken], "not empty"),
        (["rotate", folder, "-o", folder / "inside"], "inside the input folder"),
        (["rotate", tmp_path, "-o", tmp_path / "o"], "genai_config.json"),
    ]
    for argv, words in cases:
        code, _, err = cli(capsys, *argv)
        assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert (taken / "keep.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli(capsys, "rotate", folder, "-o", empty)[0] == 0  # an empty folder is taken
    assert (empty / "model.onnx").is_file()


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_with_past_exports_generate_the_same_tokens_in_a_plain_ort_loop(
    with_past_export, genai_folder, capsys, tmp_path, family, exporter
):
    path, _ = with_past_export(family, exporter)
    prompts = seeded.prompt_ids(genai_folder("llama") / "tokenizer.json")
    reference = [seeded.greedy_ort(path, prompt, STEPS) for prompt in prompts]
    for verb, extra in (("fold", []), ("rotate", []), ("slice", ["--ratio", "0", "--calib", "synthetic"])):
        out = tmp_path / f"{verb}.onnx"
        code, _, err = cli(capsys, verb, path, "-o", out, *extra)
        assert code == 0, err
        assert [seeded.greedy_ort(out, prompt, STEPS) for prompt in prompts] == reference, verb


def test_the_python_api_and_slice_pass_write_folders(genai_folder, tmp_path):
    folder = genai.open_folder(genai_folder("llama"))
    prompt = seeded.prompt_ids(folder.tokenizer)[1]
    rotated = rotate_onnx(str(folder.model))
    genai.write_folder(folder, rotated.ir_model, tmp_path / "rotated")
    assert seeded.greedy_genai(tmp_path / "rotated", prompt, STEPS) == seeded.greedy_genai(folder.path, prompt, STEPS)
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(seeded.prompts() * 6))
    slicer = SlicePass(str(calib), SliceOptions(ratio=0.25, round_to=8, tokenizer=str(folder.tokenizer)))
    sliced = slicer(io.load_ir(folder.model))
    assert slicer.result is not None and genai.sliced_widths(slicer.result) == {64: 48}
    genai.write_folder(folder, sliced.model, tmp_path / "sliced", genai.sliced_widths(slicer.result))
    assert json.loads((tmp_path / "sliced" / "genai_config.json").read_text())["model"]["decoder"]["hidden_size"] == 48
    assert len(seeded.greedy_genai(tmp_path / "sliced", prompt, STEPS)) == len(prompt) + STEPS


def test_replace_and_viz_read_a_folders_decoder_and_never_overwrite_its_files(genai_folder, capsys, tmp_path):
    folder = genai_folder("phi")
    before = listing(folder)
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(seeded.prompts() * 6))
    for argv in (
        ["replace", folder, "--calib", calib, "-o", folder / "model.onnx"],
        ["viz", folder, "-o", folder / "model.onnx.data", "--format", "html"],
        ["inspect", folder, "--graph", folder / "model.onnx"],
    ):
        code, _, err = cli(capsys, *argv)
        assert code == 2 and "must not overwrite" in err, err
    assert listing(folder) == before
    code, out, err = cli(capsys, "replace", folder, "--calib", calib, "-o", tmp_path / "r.onnx")  # its tokenizer
    assert code == 0 and "3 of 3 norms folded exactly" in out, err
