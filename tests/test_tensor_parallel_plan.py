"""The (dp, tp) arithmetic of overlap.plan.tensor_parallel and `overlap simulate --tensor-parallel`."""
from __future__ import annotations

import pytest

from overlap.cli.simulate import CLUSTERS, MODELS, main
from overlap.plan.links import LinkModel
from overlap.plan.memory import ActivationShape, activation_bytes
from overlap.plan.tensor_parallel import (STATE_BYTES, ClusterShape, TransformerShape, choose_tp, tp_all_reduce_s,
                                          tp_degrees, tp_options)

NODE = LinkModel("nvlink", 1e-6, 370e9, "preset")


def _shape(name: str) -> TransformerShape:
    m = MODELS[name]
    return TransformerShape(m.layers, m.hidden, m.heads, m.kv_heads, m.vocab, m.seq, m.layer_params, m.embedding_params)


def _cluster(nodes: int = 8, memory: float = 80e9) -> ClusterShape:
    return ClusterShape(nodes, 8, 989e12 * 0.4, memory, NODE, 5e-6, 46e9)


def test_tp_degrees_divide_the_node_the_heads_and_the_batch() -> None:
    assert tp_degrees(_shape("llama3-70b"), _cluster(), 64) == [1, 2, 4, 8]
    assert tp_degrees(_shape("gpt2-xl"), _cluster(), 64) == [1]            # 25 heads
    assert tp_degrees(_shape("llama3-70b"), _cluster(), 8) == [8]          # dp must divide the batch


def test_tp_all_reduce_is_the_ring_formula() -> None:
    nbytes = 64e6
    assert tp_all_reduce_s(nbytes, 1, _cluster()) == 0.0
    assert tp_all_reduce_s(nbytes, 4, _cluster()) == pytest.approx(8e-6 + 6 * 1e-6 + 1.5 * nbytes / 370e9)


def test_tp_trades_gathers_and_states_for_per_layer_all_reduces() -> None:
    model = _shape("llama3-70b")
    options = {o.tp: o for o in tp_options(model, _cluster(), 64, depth=1, checkpointing=True)}
    assert options[1].tp_comm_s == 0.0
    assert options[2].tp_comm_s < options[4].tp_comm_s < options[8].tp_comm_s
    # One rank's gathered layers are 1/tp of the layer; memory per rank falls with tp.
    assert options[8].prediction.peak_gathered_bytes == pytest.approx(options[1].prediction.peak_gathered_bytes / 8,
                                                                       rel=1e-3)
    assert options[1].memory_bytes > options[2].memory_bytes > options[8].memory_bytes
    assert options[8].memory_bytes > STATE_BYTES * model.params / 64                  # states are the floor
    # Compute per GPU is the same at every tp (the global batch is fixed): steps differ by communication.
    compute = {tp: o.prediction.compute_s - o.tp_comm_s for tp, o in options.items()}
    assert max(compute.values()) == pytest.approx(min(compute.values()), rel=1e-6)


def test_checkpointing_adds_one_forward_of_compute_and_keeps_its_memory_saving() -> None:
    """One node of 8, one sequence: tp 8 at dp 1, so the step is compute and TP's all-reduces.
    A layer on one rank: 512 tokens x (6 x 10M + 12 x 1024 x 512) FLOPs / 8 = 4.243e9 FLOPs,
    of which forward is a third, 1.414e9 FLOPs: 14.14 us at 100 TFLOP/s. Recomputing it in
    both layers' backward adds 28.28 us; TP's all-reduces and the memory do not change."""
    model = TransformerShape(layers=2, hidden=1024, heads=8, kv_heads=8, vocab=1000, seq=512,
                             layer_params=10_000_000, embedding_params=2_000_000)
    cluster = ClusterShape(1, 8, 1e14, 80e9, NODE, 5e-6, 46e9)
    [plain] = tp_options(model, cluster, 1)
    [recomputed] = tp_options(model, cluster, 1, checkpointing=True)
    assert (recomputed.tp, recomputed.dp) == (8, 1)
    assert recomputed.step_s == pytest.approx(plain.step_s + 2 * 14.142e-6, abs=1e-9)
    assert recomputed.tp_comm_s == plain.tp_comm_s
    prediction = recomputed.prediction
    activations = activation_bytes(ActivationShape(1, 512, 1024, 2, 8, 1000), 2, True) / 8
    assert recomputed.memory_bytes == pytest.approx(STATE_BYTES * model.params / 8 + prediction.peak_gathered_bytes
                                                    + 10_000_000 / 8 * 4 + activations)
    assert recomputed.memory_bytes < plain.memory_bytes


def test_the_pick_is_the_fastest_split_that_fits() -> None:
    options = tp_options(_shape("llama3-70b"), _cluster(), 64, depth=1, checkpointing=True)
    pick = choose_tp(options, 80e9)
    assert pick is min(options, key=lambda o: o.step_s)
    smallest = min(o.memory_bytes for o in options)
    assert choose_tp(options, smallest).memory_bytes == smallest
    assert choose_tp(options, smallest * 0.99) is None


def test_simulate_prints_the_splits_and_the_pick(capsys) -> None:
    assert "8x8xH100-ib-ndr" in CLUSTERS
    assert main(["--model", "llama3-70b", "--cluster", "8x8xH100-ib-ndr", "--checkpointing", "--tensor-parallel"]) == 0
    out = capsys.readouterr().out
    table = out[out.index("tensor parallel x ZeRO-3"):].splitlines()
    assert [line.split()[:2] for line in table[2:6]] == [["64", "1"], ["32", "2"], ["16", "4"], ["8", "8"]]
    assert sum("<- pick" in line for line in table) == 1


def _estimate_rows(capsys, *extra: str) -> dict[str, float]:
    from overlap.cli.estimate import main as estimate_main

    assert estimate_main(["--params", "70e9", "--world", "8", "--seq", "8192", "--batch", "1", "--layers", "80",
                          "--hidden", "8192", "--heads", "64", "--ckpt", *extra]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: float(line.split()[-1]) for line in out.splitlines()[:10]
            if line.split() and line.split()[0] in ("weights", "activations", "total")}
    return rows


def test_estimate_splits_states_and_activations_over_tp(capsys) -> None:
    """--tp 8 on 8 dp ranks: every category per rank is 1/8 of the same model on 8 ranks without TP."""
    whole, split = _estimate_rows(capsys), _estimate_rows(capsys, "--tp", "8")
    for category in ("weights", "activations", "total"):
        assert split[category] == pytest.approx(whole[category] / 8, rel=0.02), category
