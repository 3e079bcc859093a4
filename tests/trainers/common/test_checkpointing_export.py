"""Checkpoint atomicity + keep-K + RNG round trip; PEFT export loads in peft and matches a
hand-merged reference."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from trainers.common.checkpointing import (
    TrainerState,
    capture_host_rng,
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    restore_host_rng,
    save_checkpoint,
)
from trainers.common.data import DataCursor
from trainers.common.peft_export import (
    lora_key,
    read_peft_adapter,
    write_manifest,
    write_peft_adapter,
)


def _state(step: int) -> TrainerState:
    return TrainerState(step=step, epoch=0, cursor=DataCursor(0, step * 2), metrics={"train_loss": 1.0 / step})


def test_keep_last_k_and_latest(tmp_path):
    for step in (1, 2, 3, 4, 5):
        save_checkpoint(tmp_path, _state(step), lambda d: (d / "w.bin").write_bytes(b"x"), keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert latest_checkpoint(tmp_path) == tmp_path / "step-5"
    st = load_trainer_state(tmp_path / "step-5")
    assert st.cursor == DataCursor(0, 10) and st.metrics == {"train_loss": 0.2}
    # the same step again replaces it (SIGTERM right after a periodic save)
    save_checkpoint(tmp_path, _state(5), lambda d: (d / "w.bin").write_bytes(b"y"), keep_last=2)
    assert (tmp_path / "step-5" / "w.bin").read_bytes() == b"y"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-4", "step-5"]  # no tmp leftovers


def test_a_crashed_write_is_never_the_latest(tmp_path):
    save_checkpoint(tmp_path, _state(1), lambda d: None, keep_last=3)

    def crash(d):
        (d / "half.bin").write_bytes(b"partial")
        raise OSError("disk went away")

    with pytest.raises(OSError):
        save_checkpoint(tmp_path, _state(2), crash, keep_last=3)
    (tmp_path / "step-9").mkdir()  # a directory without trainer_state.json is not complete
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"
    assert latest_checkpoint(tmp_path / "missing") is None


def test_host_rng_round_trip_through_json():
    random.seed(3)
    np.random.seed(4)
    saved = json.loads(json.dumps(capture_host_rng()))
    want = (random.random(), np.random.rand(3).tolist())
    random.seed(99)
    np.random.seed(99)
    restore_host_rng(saved)
    assert (random.random(), np.random.rand(3).tolist()) == want


def _random_adapter(cfg, r, modules, seed=0):
    rng = np.random.default_rng(seed)
    head = cfg.hidden_size // cfg.num_attention_heads
    dims = {
        "q_proj": (cfg.hidden_size, cfg.num_attention_heads * head),
        "k_proj": (cfg.hidden_size, cfg.num_key_value_heads * head),
        "v_proj": (cfg.hidden_size, cfg.num_key_value_heads * head),
        "o_proj": (cfg.num_attention_heads * head, cfg.hidden_size),
        "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }
    weights = {}
    for layer in range(cfg.num_hidden_layers):
        for m in modules:
            fan_in, fan_out = dims[m]
            weights[lora_key(layer, m, "A")] = rng.normal(0, 0.1, (r, fan_in)).astype(np.float32)
            weights[lora_key(layer, m, "B")] = rng.normal(0, 0.1, (fan_out, r)).astype(np.float32)
    return weights


def test_exported_adapter_loads_in_peft_and_equals_hand_merged_weights(tmp_path, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
    r, alpha, modules = 4, 8.0, ("q_proj", "v_proj", "down_proj")
    weights = _random_adapter(base.config, r, modules)
    out = write_peft_adapter(tmp_path / "adapter", weights, r=r, alpha=alpha, dropout=0.0,
                             target_modules=modules, base_model_name_or_path=str(tiny_model_dir))
    config, back = read_peft_adapter(out)
    assert config["peft_type"] == "LORA" and set(back) == set(weights)

    ids = torch.tensor([[256, 259, 117, 115, 101, 114, 260, 10, 10, 104, 105]])
    peft_model = PeftModel.from_pretrained(base, str(out)).eval()
    # every exported tensor was loaded (a name mismatch would leave peft's init values)
    loaded = {k.replace(".default", ""): v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert set(loaded) == set(weights)
    with torch.no_grad():
        got = peft_model(ids).logits

    # reference: W + (alpha / r) * B @ A merged by hand into a fresh copy of the base
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir)).eval()
    sd = ref.state_dict()
    for layer in range(ref.config.num_hidden_layers):
        for m in modules:
            parent = "self_attn" if m.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            key = f"model.layers.{layer}.{parent}.{m}.weight"
            a = torch.from_numpy(weights[lora_key(layer, m, "A")])
            b = torch.from_numpy(weights[lora_key(layer, m, "B")])
            sd[key] = sd[key] + (alpha / r) * (b @ a)
    ref.load_state_dict(sd)
    with torch.no_grad():
        want = ref(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert (got - plain).abs().max() > 1e-2


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda w: w.pop(lora_key(0, "q_proj", "B")), "must both be present"),
        (lambda w: w.update({"model.layers.0.q_proj.weight": np.zeros((4, 4))}), "not a PEFT LoRA key"),
        (lambda w: w.update({lora_key(0, "q_proj", "A"): np.zeros((3, 64), np.float32)}), "expected lora_A"),
        (lambda w: w.update({lora_key(0, "up_proj", "A"): np.zeros((4, 64), np.float32)}), "not in target_modules"),
    ],
)
def test_export_rejects_bad_weights(tmp_path, mutate, message):
    weights = {lora_key(0, "q_proj", "A"): np.zeros((4, 64), np.float32),
               lora_key(0, "q_proj", "B"): np.zeros((64, 4), np.float32)}
    mutate(weights)
    with pytest.raises(ValueError, match=message):
        write_peft_adapter(tmp_path, weights, r=4, alpha=8, dropout=0, target_modules=("q_proj",))


def test_manifest_lists_every_file_with_sha256(tmp_path):
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "a.bin").write_bytes(b"abc")
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    files = write_manifest(tmp_path)
    assert files == [
        {"name": "adapter/a.bin", "bytes": 3,
         "sha256": "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {"name": "metrics.jsonl", "bytes": 3, "sha256": files[1]["sha256"]},
    ]
    assert json.loads((tmp_path / "manifest.json").read_text())["files"] == files
    assert write_manifest(tmp_path) == files  # the manifest never lists itself


# A process whose files may not grow past their size now plus 40 bytes (RLIMIT_FSIZE: the
# kernel writes up to the limit, then refuses, as a disk that fills mid-write does).
FILLED_MID_LINE = """
import json, resource, signal, sys
from trainers.common.outputs import MetricsLog
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
log = MetricsLog(sys.argv[1])
log.append({"step": 1, "train_loss": 1.5})
resource.setrlimit(resource.RLIMIT_FSIZE, (log.path.stat().st_size + 40, resource.RLIM_INFINITY))
try:
    log.append({"step": 2, "train_loss": 1.25, "note": "x" * 200})
except OSError as exc:
    print(exc.errno)
"""


def test_a_metrics_line_the_disk_cuts_short_is_taken_back(tmp_path):
    import errno
    import subprocess
    import sys

    from tests.conftest import REPO

    done = subprocess.run([sys.executable, "-c", FILLED_MID_LINE, str(tmp_path)], cwd=REPO, capture_output=True,
                          text=True, check=True, timeout=60)
    assert done.stdout.strip() == str(errno.EFBIG), done.stderr
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1, "train_loss": 1.5}\n'
