"""The (dp, tp, pp, microbatches, schedule) arithmetic of overlap.plan.pipeline and
`overlap simulate --pipeline`, against the schedules' own formulas worked by hand."""
from __future__ import annotations

import pytest

from overlap.cli.simulate import main
from overlap.plan.links import LinkModel
from overlap.plan.pipeline import (PipelineLayout, choose_pipeline, evaluate_pipeline, p2p_link, pipeline_layouts,
                                   pipeline_options)
from overlap.plan.tensor_parallel import ClusterShape, TransformerShape

NODE = LinkModel("nvlink", 1e-6, 370e9, "preset")
FLOPS = 989e12 * 0.4
# A small dense model: 16 layers, every number round.
MODEL = TransformerShape(layers=16, hidden=1024, heads=16, kv_heads=16, vocab=32000, seq=2048,
                         layer_params=12 * 1024 * 1024, embedding_params=32000 * 1024)


def _cluster(nodes: int = 2, memory: float = 80e9) -> ClusterShape:
    return ClusterShape(nodes, 8, FLOPS, memory, NODE, 5e-6, 46e9)


def test_one_f_one_b_is_m_plus_pp_minus_one_slots_of_the_slowest_stage() -> None:
    cluster = _cluster()
    layout = PipelineLayout(dp=8, tp=1, pp=2, microbatch=1, schedule="1F1B")
    option = evaluate_pipeline(MODEL, cluster, 64, layout)
    m = 64 // 8
    tokens = MODEL.seq
    layer = tokens * (6 * MODEL.layer_params + 12 * MODEL.hidden * MODEL.seq) / FLOPS
    head = tokens * 6 * MODEL.vocab * MODEL.hidden / FLOPS
    send = p2p_link(layout, cluster).time(tokens * MODEL.hidden * 2)
    slot = 8 * layer + head + 2 * send
    assert option.microbatches == m
    assert option.bubble == pytest.approx(1 / (m + 1))
    assert option.step_s - option.zero_exposed_s == pytest.approx((m + 1) * slot)
    assert option.p2p_s == pytest.approx((m + 1) * 2 * send)
    # The stages are 8 ranks each (tp * dp fills a node): their sends cross the network.
    assert p2p_link(layout, cluster).link == "network"


def test_interleaving_shrinks_the_bubble_and_multiplies_the_sends() -> None:
    cluster = _cluster()
    plain = evaluate_pipeline(MODEL, cluster, 64, PipelineLayout(4, 1, 4, 1, "1F1B"))
    interleaved = evaluate_pipeline(MODEL, cluster, 64, PipelineLayout(4, 1, 4, 1, "Interleaved1F1B", 2))
    assert interleaved.bubble < plain.bubble
    m = 16
    assert plain.bubble == pytest.approx(3 / (m + 3))
    assert interleaved.bubble == pytest.approx(3 / (2 * m + 3))
    assert interleaved.p2p_s == pytest.approx(plain.p2p_s * (2 * m + 3) / (m + 3))


def test_gpipe_holds_every_microbatch_and_1f1b_pp_of_them() -> None:
    cluster = _cluster(memory=1e15)
    one_f = evaluate_pipeline(MODEL, cluster, 64, PipelineLayout(4, 1, 4, 1, "1F1B"))
    gpipe = evaluate_pipeline(MODEL, cluster, 64, PipelineLayout(4, 1, 4, 1, "GPipe"))
    assert gpipe.step_s == pytest.approx(one_f.step_s)
    assert gpipe.memory_bytes > one_f.memory_bytes


def test_units_are_kept_when_memory_allows_and_regathered_otherwise() -> None:
    layout = PipelineLayout(4, 1, 4, 1, "1F1B")
    roomy = evaluate_pipeline(MODEL, _cluster(memory=1e15), 64, layout)
    assert roomy.kept
    tight = evaluate_pipeline(MODEL, _cluster(memory=roomy.memory_bytes - 1), 64, layout)
    assert not tight.kept and tight.memory_bytes < roomy.memory_bytes
    assert tight.zero_exposed_s >= roomy.zero_exposed_s


def test_layouts_respect_the_schedules_constraints() -> None:
    for layout in pipeline_layouts(MODEL, _cluster(), 64):
        dp_batch = 64 // layout.dp
        assert layout.dp * layout.tp * layout.pp == 16 and 64 % layout.dp == 0
        if layout.pp > 1:
            assert dp_batch >= layout.pp
        if layout.schedule == "Interleaved1F1B":
            assert dp_batch % layout.pp == 0 and MODEL.layers >= layout.pp * layout.virtual


def test_the_pick_is_the_fastest_layout_that_fits() -> None:
    options = pipeline_options(MODEL, _cluster(), 64)
    pick = choose_pipeline(options, 80e9)
    assert pick is min((o for o in options if o.memory_bytes <= 80e9), key=lambda o: o.step_s)
    assert choose_pipeline(options, 1.0) is None


def test_simulate_prints_layouts_the_pick_and_the_published_recipe(capsys) -> None:
    assert main(["--model", "llama3-70b", "--cluster", "8x8xH100-ib-ndr", "--pipeline", "--global-batch", "256"]) == 0
    out = capsys.readouterr().out
    assert "pipeline x tensor parallel x ZeRO-3 at a global batch of 256" in out
    assert out.count("<- pick") == 1
    assert "published: Megatron-Bridge" in out and "(context parallelism left out)" in out
    assert main(["--model", "llama3-405b", "--cluster", "32x8xH100-ib-ndr", "--pipeline"]) == 0
    out = capsys.readouterr().out
    assert "published: Llama 3 paper" in out and "  here: " in out
    with pytest.raises(SystemExit):
        main(["--model", "llama3-70b", "--cluster", "8x8xH100-ib-ndr", "--pipeline", "--microbatch", "0"])
