"""engine/op_choice.py: the attention and elementwise ops' C kernels or torch paths, chosen
per CPU as the linears' kernels are. The probes that make a torch path eligible (a row's bits
whatever its batch or chunk) on the real kernels and on paths planted to fail them, the rule
on given timings, and an engine running every torch path (the real model, against
transformers)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from engine import kernel_choice as kc
from engine import layer_ops
from engine import op_choice as oc
from engine.kernel_tags import TORCH_PREFIX, is_kernel_tag
from engine.request import SamplingParams
from tests.engine.conftest import make_engine, run_all, varied_prompts
from tests.engine.test_correctness import hf_greedy, hf_model  # noqa: F401  (a fixture)

SMALL_BATCHES = (1, 2, 3, 17, 64, 65, 333)


def ops_by_name(config) -> dict[str, oc.FallbackOp]:  # noqa: ANN001
    return {op.name: op for op in oc.available_ops(config)}


def c_layer_ops() -> dict:
    return {"norm": layer_ops.add_rms_norm,
            "rope": lambda qk, pos, cos, sin: (layer_ops.rope_(qk, pos, cos, sin), qk)[1],
            "silu_mul": layer_ops.silu_mul}


def test_the_c_kernels_rows_do_not_depend_on_the_batch_or_the_chunk(loaded) -> None:  # noqa: ANN001
    """What a torch path must show to be taken, the C kernels have (the probe passes them)."""
    ops = ops_by_name(loaded.config)
    if oc.LAYER_OPS not in ops:
        pytest.skip("the C layer ops are not built here")
    with torch.inference_mode():
        assert oc.layer_invariant(ops[oc.LAYER_OPS], c_layer_ops(), SMALL_BATCHES, oc.probe_threads())
        for name in (oc.ATTN_DECODE, oc.ATTN_PREFILL):
            if name in ops:
                assert oc.attention_invariant(ops[name], c=True, threads=oc.probe_threads()), name


def test_the_probes_reject_a_path_whose_rows_depend_on_the_batch(loaded, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    op = oc.model_ops(loaded.config)
    layer, decode, prefill = (next(o for o in op if o.name == n) for n in (oc.LAYER_OPS, oc.ATTN_DECODE, oc.ATTN_PREFILL))
    c_layer = c_layer_ops()  # invariant (the test above)
    with torch.inference_mode():
        for step in ("norm", "rope", "silu_mul"):  # one step whose last bit follows the batch size
            planted = dict(c_layer)
            planted[step] = lambda *a, f=c_layer[step]: (y := f(*a)).add_(y.shape[0] * 1e-7)
            assert not oc.layer_invariant(layer, planted, SMALL_BATCHES), step

        real = oc._attention

        def by_rows(op, cache, q, spans, c):  # noqa: ANN001, ANN202  (rows that follow the pass's size)
            return real(op, cache, q, spans, c).add_(q.shape[0] * 1e-7)
        monkeypatch.setattr(oc, "_attention", by_rows)
        for op in (decode, prefill):  # on the C kernels, invariant unplanted where built
            assert not oc.attention_invariant(op, c=True), op.name


def test_torch_is_taken_only_when_faster_in_every_round_and_invariant(loaded, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    op = oc.model_ops(loaded.config)[0]
    monkeypatch.setattr(oc, "timing_cases", lambda op: [])
    rounds: list[tuple[float, float]] = []
    monkeypatch.setattr(oc, "time_cases", lambda cases: rounds.pop(0))
    probed: list[bool] = []

    def probe(result: bool):  # noqa: ANN202
        return lambda op: probed.append(result) or result

    monkeypatch.setattr(oc, "torch_invariant", probe(True))
    rounds[:] = [(1.0, 0.5), (1.0, 0.6), (1.0, 0.5)]
    c = oc.calibrate(op)
    assert (c.kernel, c.invariant, c.other) == (kc.TORCH, True, "torch") and probed == [True]
    assert c.describe() == "calibrated: torch / C time 0.50"
    rounds[:] = [(1.0, 0.5), (1.0, 0.95)]  # a burst in the first round only
    assert oc.calibrate(op).kernel == kc.C and probed == [True]
    rounds[:] = [(1.0, 0.9)]  # within the margin
    assert oc.calibrate(op).kernel == kc.C
    monkeypatch.setattr(oc, "torch_invariant", probe(False))
    rounds[:] = [(1.0, 0.5), (1.0, 0.5), (1.0, 0.5)]
    c = oc.calibrate(op)
    assert (c.kernel, c.invariant) == (kc.C, False) and "torch's rows depend on the batch" in c.describe()


def test_choices_are_cached_beside_the_linears_and_forced_modes_time_nothing(loaded, tmp_path: Path) -> None:  # noqa: ANN001
    path = tmp_path / "kernels.json"
    ops = oc.model_ops(loaded.config)
    measured: list[str] = []

    def measure(op: oc.FallbackOp) -> kc.Choice:
        measured.append(op.name)
        return kc.Choice(kc.TORCH if op.name == oc.ATTN_PREFILL else kc.C, 1.0, 0.5, True, "calibrated", other="torch")

    first = oc.choose(ops, "auto", path, measure)
    assert measured == [oc.ATTN_DECODE, oc.ATTN_PREFILL, oc.LAYER_OPS]
    kc.choose(kc.linear_ops(loaded.config)[:1], "auto", path, lambda op: kc.Choice(kc.C, 1.0, 1.0))
    cached = oc.choose(ops, "auto", path, lambda op: pytest.fail("measured again"))
    assert {n: c.kernel for n, c in cached.items()} == {n: c.kernel for n, c in first.items()}
    assert cached[oc.ATTN_PREFILL].describe() == "cached: torch / C time 0.50"
    (entries,) = json.loads(path.read_text()).values()
    assert sorted(entries) == sorted([op.key for op in ops] + [kc.linear_ops(loaded.config)[0].key])
    digest = hashlib.sha256(kc.machine_key().encode()).hexdigest()[:8]
    assert oc.tag(cached) == f"{TORCH_PREFIX}attn_prefill@{digest}" and is_kernel_tag(kc.isa_tag() + oc.tag(cached))
    # an entry naming a kernel the op does not have is measured again, not run as C under a tag
    cache = json.loads(path.read_text())
    cache[kc.machine_key()][ops[0].key]["kernel"] = kc.ONEDNN
    path.write_text(json.dumps(cache))
    again = oc.choose(ops, "auto", path, measure)
    assert measured[3:] == [ops[0].name] and again[ops[0].name].kernel == kc.C
    for mode in ("c", "onednn"):
        forced = oc.choose(ops, mode, path, lambda op: pytest.fail("timed a forced choice"))
        assert {c.kernel for c in forced.values()} == {kc.C} and oc.tag(forced) == ""
    with pytest.raises(ValueError, match="kernels must be one of"):
        oc.choose(ops, "fast", path)


@pytest.mark.slow
def test_an_engine_on_every_torch_path_names_them_and_answers_as_transformers(
        loaded, hf_model, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001, F811
    """A machine whose calibration took torch for all three ops: the engine runs them (its report
    and fingerprint say so) and its greedy tokens are transformers', prefix hits and chunks included."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    ops = oc.available_ops(loaded.config, silu=False)  # the gated panels fuse the SiLU
    oc.choose(ops, "auto", None, lambda op: kc.Choice(kc.TORCH, 1.0, 0.5, True, "calibrated", other="torch"))
    kc.choose(kc.linear_ops(loaded.config), "auto", None, lambda op: kc.Choice(kc.C, 1.0, 1.0, None, "calibrated"))
    engine = make_engine(loaded, kv_cache_bytes=64 << 20, max_num_batched_tokens=96)
    c = make_engine(loaded, kv_cache_bytes=16 << 20, kernels="c")
    try:
        names = ",".join(sorted(op.name for op in ops))
        assert TORCH_PREFIX + names + "@" in engine.fingerprint and is_kernel_tag(engine.fingerprint.split("|hd64", 1)[1])
        assert engine.fingerprint.startswith(c.fingerprint) and TORCH_PREFIX not in c.fingerprint
        report = engine.model.kernels()
        assert report["norms, RoPE, SiLU"].startswith("torch [cached")
        assert not engine.model.fused and engine.model.op_choices[oc.LAYER_OPS].kernel == kc.TORCH
        names_run = {op.name for op in ops}
        assert engine.model.attention.keywords == {"c_decode": oc.ATTN_DECODE not in names_run,
                                                   "c_prefill": oc.ATTN_PREFILL not in names_run}
        for line in ("attention, decode", "attention, prefill"):
            if any(op.name == {"attention, decode": oc.ATTN_DECODE}.get(line, oc.ATTN_PREFILL) for op in ops):
                assert report[line].startswith("torch SDPA [cached"), report
        assert c.model.kernels()["norms, RoPE, SiLU"] == "C layer ops [forced]"
        prompts = varied_prompts(loaded.tokenizer)[::4]
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        expected = [hf_greedy(hf_model, prompt, params.max_tokens) for prompt in prompts]
        for _ in range(2):  # the second time from the prefix cache: a hit's suffix as a chunk
            outs = run_all(engine, prompts, params)
            assert [o.token_ids for o in outs] == expected
        assert sum(o.num_cached_tokens for o in outs) > 0 and max(len(p) for p in prompts) > 96
    finally:
        engine.close()
        c.close()
