"""The expert-parallel arithmetic of overlap.plan.expert_parallel and `overlap simulate --moe`,
against numbers worked by hand on a tiny model and cluster."""
from __future__ import annotations

import pytest

from overlap.cli.published import PUBLISHED_MOE
from overlap.cli.simulate import MOE_MODELS, main
from overlap.plan.expert_parallel import (LayerCost, MoEShape, a2a_bytes, a2a_s, choose_ep, ep_options, ep_sizes,
                                          evaluate_ep, moe_activation_bytes, network_share, nodes_to_fit,
                                          two_chunk_exposed, zero3_step_s)
from overlap.plan.links import LinkModel
from overlap.plan.tensor_parallel import ClusterShape

# One dense layer then one MoE layer of 4 experts (top-2) and a shared expert; every count small.
TINY = MoEShape(layers=2, dense_layers=1, hidden=64, heads=4, vocab=100, seq=8, attention_params=1000, dense_ffn=128,
                experts=4, top_k=2, expert_ffn=32, shared_experts=1)
NODE = LinkModel("nvlink", 1e-6, 100e9, "preset")


def _cluster(flops: float = 1e12, memory: float = 1e9, nodes: int = 2) -> ClusterShape:
    """`nodes` nodes of 2 GPUs; network 10 GB/s, 5 µs a step; NVLink 100 GB/s, 1 µs."""
    return ClusterShape(nodes, 2, flops, memory, NODE, 5e-6, 10e9, base_alpha=8e-6)


def test_parameter_counts() -> None:
    assert TINY.expert_params == 3 * 64 * 32 == 6144
    assert TINY.moe_dense_params == 1000 + 4 * 64 + 6144
    assert TINY.dense_params == (1000 + 3 * 64 * 128) + 7400 + (2 * 100 * 64 + 64) == 45840
    assert TINY.routed_params == 4 * 6144
    assert TINY.params == 70416 and TINY.active_params == 45840 + 2 * 6144
    # The presets match the published sizes: 671B / 37B and 30.5B / 3.3B.
    deepseek, qwen = MOE_MODELS["deepseek-v3"], MOE_MODELS["qwen3-30b-a3b"]
    assert deepseek.params == pytest.approx(671.0e9, rel=1e-3) and deepseek.active_params == pytest.approx(37.5e9, rel=0.01)
    assert qwen.params == pytest.approx(30.5e9, rel=2e-3) and qwen.active_params == pytest.approx(3.35e9, rel=0.01)


def test_all_to_all_bytes_and_the_share_that_leaves_the_node() -> None:
    tokens = TINY.seq                                        # one sequence per rank
    assert a2a_bytes(TINY, tokens, 1) == 0
    assert a2a_bytes(TINY, tokens, 4) == 8 * 2 * 64 * 2 * 3 / 4 == 1536
    assert network_share(2, 2) == 0.0                        # the group inside a node
    assert network_share(4, 2) == pytest.approx(2 / 3)       # 2 of the 3 peers on the other node
    cluster = _cluster()
    assert a2a_s(1536, 4, cluster) == pytest.approx(8e-6 + 5e-6 + 1536 * 2 / 3 / 10e9)
    assert a2a_s(1024, 2, cluster) == pytest.approx(8e-6 + 1e-6 + 1024 / 100e9)
    assert a2a_s(1024, 1, cluster) == 0.0
    # Four all-to-alls a layer (dispatch and combine, forward and backward).
    assert evaluate_ep(TINY, cluster, 1, 4).a2a_bytes_per_layer == 4 * 1536


def test_halves_and_own_parts_hide_the_all_to_alls_as_far_as_compute_lasts() -> None:
    assert two_chunk_exposed(1.0, 3.0, 0.0) == 2.0           # the halves outlast: the middle two of four hidden
    assert two_chunk_exposed(3.0, 1.0, 0.0) == 10.0          # two halves of compute hidden
    assert two_chunk_exposed(1.0, 3.0, 0.5) == 1.0           # an own part hides half the first and the last
    assert two_chunk_exposed(1.0, 3.0, 2.0) == 0.0           # and all of them
    # Slow compute: each pass's four half all-to-alls all hidden.
    slow = _cluster(flops=1e6)
    option = evaluate_ep(TINY, slow, 1, 4)
    half = a2a_s(768, 4, slow)
    assert option.a2a_s == pytest.approx(8 * half)
    assert option.a2a_hidden_s == pytest.approx(8 * half) and option.a2a_exposed_s == pytest.approx(0)
    # Checkpointing runs forward's all-to-alls again in the recompute.
    again = evaluate_ep(TINY, slow, 1, 4, checkpointing=True)
    assert again.a2a_s == pytest.approx(12 * half) and again.a2a_hidden_s == pytest.approx(12 * half)
    # Fast compute hides only as much as the experts take: 2c + 2o a pass, backward's twice
    # forward's; at E = 4 a half of the sent pairs is 3/8 of the experts' compute, an own part 1/8.
    fast = _cluster(flops=1e15)
    quick = evaluate_ep(TINY, fast, 1, 4)
    expert_forward = 8 * 6 * 2 * 6144 / 1e15 / 3
    sent_half, own_part = expert_forward * 3 / 8, expert_forward / 8
    assert quick.a2a_hidden_s == pytest.approx(3 * (2 * sent_half + 2 * own_part))


def test_step_with_prefetch_depth_one() -> None:
    layers = [LayerCost(1.0, 2.0, 0.5, 0.5, 0, 0.0, 0.0), LayerCost(1.0, 2.0, 1.5, 3.0, 0, 0.0, 0.0)]
    # forward: root 0.1 + first gather 0.5 + max(1, 1.5) + 1; head 0.3;
    # backward: max(2, 3) + max(2, 0.5); then the first layer's and the root's reductions.
    assert zero3_step_s(layers, 0.1, 0.2, 0.3) == pytest.approx(0.6 + 1.5 + 1.0 + 0.3 + 3.0 + 2.0 + 0.5 + 0.2)


def test_memory_per_rank() -> None:
    # Activations: the layer formula's 16·e·sbh + LSE less its 4h MLP (8·e·sbh) = 8320 bytes, plus
    # the MoE MLP's 2·8·(2·(2·64 + 3·32) + 3·32) + 4·8·4 = 8832, the dense SwiGLU's 2·8·3·128 = 6144,
    # and the head's 2·2·8·64 + 4·8·100 = 5248.
    assert moe_activation_bytes(TINY, 1, False) == (8320 + 8832) + (8320 + 6144) + 5248
    assert moe_activation_bytes(TINY, 1, True) == 2 * 2 * 8 * 64 + (8320 + 8832) + 5248
    option = evaluate_ep(TINY, _cluster(), 1, 2)
    states = 16 * (45840 / 4 + 24576 / 2 / 2)                # 1/world of dense, (1/E)/(world/E) of experts
    largest = 1000 + 3 * 64 * 128                             # the dense layer outweighs 7400 + 2 experts
    assert option.memory_bytes == pytest.approx(states + 2 * (12864 + 2 * largest) + 4 * largest + 36864)
    # Model states are 1/world of every parameter whatever E.
    assert states == 16 * TINY.params / 4


def test_sizes_and_the_pick() -> None:
    cluster = _cluster()
    assert ep_sizes(TINY, cluster) == [1, 2, 4]
    assert ep_sizes(TINY, _cluster(nodes=4)) == [1, 2, 4]     # 8 ranks, but only 4 experts
    options = ep_options(TINY, cluster, 1)
    assert [o.dp for o in options] == [4, 2, 1]
    pick = choose_ep(options, 1e9)
    assert pick is min(options, key=lambda o: o.step_s)
    smallest = min(o.memory_bytes for o in options)
    assert choose_ep(options, smallest).memory_bytes == smallest
    assert choose_ep(options, smallest * 0.99) is None
    for option in options:
        assert option.step_s >= option.compute_s
        assert option.tokens_per_s == pytest.approx(TINY.seq / option.step_s)


def test_nodes_to_fit_doubles_the_cluster() -> None:
    deepseek = MOE_MODELS["deepseek-v3"]
    h100 = ClusterShape(8, 8, 989e12 * 0.4, 80e9, NODE, 5e-6, 46e9)
    assert choose_ep(ep_options(deepseek, h100, 1, True), 80e9) is None    # 168 GB of states per rank
    assert nodes_to_fit(deepseek, h100, 1, True) == 32
    assert nodes_to_fit(deepseek, h100, 1, True, max_nodes=16) is None


def test_invalid_shapes_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="top_k=5 is more than its 4 experts"):
        MoEShape(2, 0, 64, 4, 100, 8, 1000, 0, experts=4, top_k=5, expert_ffn=32)
    with pytest.raises(ValueError, match="at least one layer has experts"):
        MoEShape(2, 2, 64, 4, 100, 8, 1000, 128, experts=4, top_k=2, expert_ffn=32)
    with pytest.raises(ValueError, match="expert-parallel size 3 must divide"):
        evaluate_ep(TINY, _cluster(), 1, 3)


def test_published_deepseek_figure_is_the_reports_gpu_hours() -> None:
    report = next(p for p in PUBLISHED_MOE if "2412.19437" in p.source)
    assert report.tokens_per_s_per_gpu == pytest.approx(1543.2, abs=0.1)


def test_simulate_moe_prints_every_size_the_pick_and_published_figures(capsys) -> None:
    assert main(["--model", "qwen3-30b-a3b", "--cluster", "8x8xH100-ib-ndr", "--moe"]) == 0
    out = capsys.readouterr().out
    assert "expert parallel x ZeRO-3: qwen3-30b-a3b" in out and out.count("<- pick") == 1
    assert [line.split()[0] for line in out.splitlines()[2:9]] == ["1", "2", "4", "8", "16", "32", "64"]
    assert "published: Megatron-Bridge performance summary" in out and "left out:" in out
    assert main(["--model", "deepseek-v3", "--cluster", "8x8xH100-ib-ndr", "--moe", "--checkpointing"]) == 0
    out = capsys.readouterr().out
    assert out.count("(does not fit)") == 7 and "one fits at --nodes 32" in out
    assert "DeepSeek-V3 Technical Report (arXiv 2412.19437): 1,543 tokens/s/GPU" in out


@pytest.mark.parametrize("argv", [
    ["--model", "llama3-8b", "--cluster", "8x8xH100-ib-ndr", "--moe"],
    ["--model", "qwen3-30b-a3b", "--cluster", "8x8xH100-ib-ndr"],
    ["--model", "qwen3-30b-a3b", "--cluster", "8x8xH100-ib-ndr", "--moe", "--pipeline"],
])
def test_simulate_moe_refuses_what_it_does_not_price(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit):
        main(argv)
    assert "--moe" in capsys.readouterr().err
