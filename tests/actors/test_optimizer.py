"""``StochasticAdamW`` (``asyncrl.actors.optimizer``, ``LearnerConfig.optimizer="adamw_bf16"``), on the CPU:
stochastic rounding is unbiased and lands on the two bfloat16 neighbours only; updates far below a bfloat16 spacing,
which torch's AdamW drops, move the weights' mean along the float32 trajectory; a tiny Qwen2 trained in bfloat16
keeps its states in bfloat16 and follows the float32 run's loss; float32 parameters get torch's update exactly;
chunk size and layout change nothing, the seed does; a checkpoint (the store's, and a sharded DCP one) resumes
the run bit for bit; the config builds it."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from asyncrl.actors.optimizer import StochasticAdamW, random_bits, stochastic_round
from asyncrl.config import ConfigError, LearnerConfig
from asyncrl.recipes import default_optimizer

pytestmark = pytest.mark.timeout(60)
SPACING = 2.0 ** -7  # between bfloat16 neighbours in [1, 2)


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bfloat16 values either side of ``x`` (float32), as float32: truncated, and one spacing further out."""
    bits = x.view(torch.int32)
    below = (bits & -(1 << 16)).view(torch.float32)
    return below, (below.view(torch.int32) + (1 << 16)).view(torch.float32)


@pytest.mark.parametrize("value", [1.0 + 0.1 * SPACING, 1.0 + 0.5 * SPACING, -(1.0 + 0.93 * SPACING), 3.1e-3,
                                   -7.77e4])
def test_stochastic_rounding_is_unbiased_and_lands_on_the_two_neighbours(value: float) -> None:
    n = 1 << 18
    x = torch.full((n,), value)
    below, above = neighbours(x[:1])
    assert below.item() != value != above.item()  # strictly between two neighbours
    gap = (above - below).abs().item()
    p_above = (value - below.item()) / (above.item() - below.item())
    bound = 5 * gap * math.sqrt(p_above * (1 - p_above) / n)  # 5 standard deviations of the mean
    for key in (1, 0xDEADBEEF):  # many elements, one key
        r = stochastic_round(x, key).float()
        assert set(r.unique().tolist()) == {below.item(), above.item()}
        assert abs(r.double().mean().item() - value) < bound, (r.double().mean().item(), value, bound)
    # One element, many keys (steps): its own mean converges too.
    one = torch.stack([stochastic_round(x[:1], key, start=12345) for key in range(4096)]).float()
    assert abs(one.double().mean().item() - value) < 5 * gap * math.sqrt(p_above * (1 - p_above) / 4096)
    exact = torch.full((1000,), below.item())
    assert torch.equal(stochastic_round(exact, 7).float(), exact)  # a bfloat16 value stays itself


def test_random_bits_are_uniform_uncorrelated_and_chunk_independent() -> None:
    bits = random_bits(2024, 0, 1 << 18)
    assert bits.dtype == torch.int32 and 0 <= int(bits.min()) and int(bits.max()) < 1 << 16
    counts = torch.bincount(bits >> 12, minlength=16).double()  # 16 bins of 2**14 elements expected
    chi2 = ((counts - counts.mean()) ** 2 / counts.mean()).sum().item()
    assert chi2 < 45, chi2  # 15 degrees of freedom: p < 1e-4 above 45
    low = torch.bincount(bits & 15, minlength=16).double()  # the low bits too
    assert ((low - low.mean()) ** 2 / low.mean()).sum().item() < 45
    f = bits.double()
    assert abs(torch.corrcoef(torch.stack([f[:-1], f[1:]]))[0, 1].item()) < 0.01  # neighbours independent
    assert torch.equal(torch.cat([random_bits(2024, 0, 1000), random_bits(2024, 1000, 7)]), bits[:1007])
    assert not torch.equal(random_bits(2025, 0, 1000), bits[:1000])


@pytest.mark.parametrize("compiled", [False, True])
def test_updates_below_half_a_spacing_move_the_mean_along_the_float32_trajectory(compiled: bool) -> None:
    torch.manual_seed(0)
    start = (1.0 + torch.rand(8192) * 0.5).to(torch.bfloat16)
    lr, steps = 1e-4, 100  # an Adam step moves ~lr, 1/78 of a spacing in [1, 2): rounded to nearest, nothing moves
    params = {name: torch.nn.Parameter(start.clone()) for name in ("torch", "stochastic")}
    exact = torch.nn.Parameter(start.float())
    optimizers = [torch.optim.AdamW([params["torch"]], lr=lr, weight_decay=0.0),
                  StochasticAdamW([params["stochastic"]], lr=lr, weight_decay=0.0, seed=3, compiled=compiled),
                  torch.optim.AdamW([exact], lr=lr, weight_decay=0.0)]
    for _ in range(steps):
        for p in (*params.values(), exact):
            p.grad = torch.ones_like(p)
        for opt in optimizers:
            opt.step()
    assert torch.equal(params["torch"], start)  # every update lost
    drift = (exact - start.float()).mean().item()
    assert drift == pytest.approx(-lr * steps, rel=0.01)
    moved = (params["stochastic"].float() - start.float()).mean().item()
    # Rounding noise: ~0.009 per element after 100 steps, so ~1e-4 on the mean of 8192.
    assert moved == pytest.approx(drift, abs=5e-4), (moved, drift)


def tiny_qwen() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.testing.tiny import TinyModelSpec

    s = TinyModelSpec()
    cfg = Qwen2Config(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                      num_hidden_layers=s.num_hidden_layers, num_attention_heads=s.num_attention_heads,
                      num_key_value_heads=s.num_key_value_heads, max_position_embeddings=64,
                      tie_word_embeddings=s.tie_word_embeddings)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg)


def loss_curve(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor, steps: int
               ) -> list[float]:
    """Train on ``ids`` (next-token loss); after each step, the loss of the weights as they are, in float32."""
    curve = []
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            curve.append(copy.deepcopy(model).float()(input_ids=ids, labels=ids).loss.item())
    return curve


def test_a_tiny_model_in_bfloat16_follows_the_float32_run() -> None:
    base = tiny_qwen()
    ids = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        initial = base(input_ids=ids, labels=ids).loss.item()
    lr, steps = 1e-5, 8  # most updates are below half a spacing of the weights they change
    runs = {}
    for name, dtype, optimizer in (("float32", torch.float32, "adamw"), ("adamw_bf16", torch.bfloat16, "adamw_bf16"),
                                   ("nearest", torch.bfloat16, "adamw")):
        model = copy.deepcopy(base).to(dtype)
        opt = default_optimizer(model, LearnerConfig(lr=lr, optimizer=optimizer))
        runs[name] = [initial - loss for loss in loss_curve(model, opt, ids, steps)]  # the loss's fall
        if name == "adamw_bf16":
            states = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
            assert states and all(v.dtype == torch.bfloat16 for v in states)
    fall = runs["float32"]
    assert fall[-1] > 0.03  # it learns: the comparison below means something
    for got, want in zip(runs["adamw_bf16"], fall, strict=True):
        assert got == pytest.approx(want, rel=0.05), (runs["adamw_bf16"], fall)
    assert runs["nearest"][-1] < 0.5 * fall[-1], (runs["nearest"], fall)  # what rounding to nearest loses


def test_float32_parameters_get_torchs_adamw_update_exactly() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    twin = copy.deepcopy(model)
    ours = StochasticAdamW(model.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
                           chunk_elements=50)
    theirs = torch.optim.AdamW(twin.parameters(), lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1,
                               foreach=False)
    x = torch.randn(16, 7)
    for _ in range(5):
        for m, opt in ((model, ours), (twin, theirs)):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    assert ours.temporary_bytes() == 32 * 50


def bf16_params(seed: int = 0) -> list[torch.nn.Parameter]:
    """Three bfloat16 parameters: sizes no chunk divides evenly, and one not contiguous (a transposed view)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*shape, generator=g).to(torch.bfloat16)) for shape in ((37, 29), (101,))] + [
        torch.nn.Parameter(torch.randn(23, 41, generator=g).to(torch.bfloat16).t())]


def train(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, steps: int) -> None:
    for step in range(steps):
        for i, p in enumerate(params):
            g = torch.Generator().manual_seed(100 * step + i)
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(p.dtype)
        optimizer.step()


def fit(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, steps: int) -> None:
    """``steps`` optimiser steps of ``model`` on the mean square of its output for ``x``."""
    for _ in range(steps):
        model(x).float().square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_chunk_size_and_layout_change_nothing_and_the_seed_does() -> None:
    results = []
    for chunk, contiguous in ((1 << 20, False), (64, False), (7, False), (1 << 20, True)):
        params = bf16_params()
        if contiguous:
            params[2] = torch.nn.Parameter(params[2].detach().contiguous())
        train(params, StochasticAdamW(params, lr=1e-3, seed=5, chunk_elements=chunk), steps=3)
        assert not params[2].is_contiguous() or contiguous  # updated in place, its layout kept
        results.append([p.detach().clone() for p in params])
    start = bf16_params()
    for got in results[1:]:
        for p, q, s in zip(results[0], got, start, strict=True):
            assert torch.equal(p, q) and not torch.equal(p, s)
    other = bf16_params()
    train(other, StochasticAdamW(other, lr=1e-3, seed=6), steps=3)
    assert not all(torch.equal(p, q) for p, q in zip(results[0], other, strict=True))


def test_the_compiled_update_is_the_eager_one_and_compiles_once_for_every_step() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # another test's compiled graph would serve this one's first step
    counters.clear()
    results, graphs = [], []
    for compiled in (False, True):
        params = bf16_params()
        opt = StochasticAdamW(params, lr=1e-3, seed=5, chunk_elements=64, compiled=compiled)
        train(params, opt, steps=1)  # every chunk length (64, and the three last chunks) seen once
        graphs.append(counters["stats"]["unique_graphs"])
        train(params, opt, steps=3)
        graphs.append(counters["stats"]["unique_graphs"])
        results.append([t.detach().clone() for p in params for t in (p, opt.state[p]["exp_avg"])])
    assert graphs[:2] == [0, 0] and graphs[3] == graphs[2] > 0  # compiled in its first step, then never again
    assert not any(torch.equal(p, s) for p, s in zip(results[1][::2], bf16_params(), strict=True))  # it trained
    for eager, fused in zip(*results, strict=True):
        # Float32 arithmetic fused may differ in the last place, and a rounding then land on the other neighbour.
        assert (eager == fused).float().mean().item() > 0.99
        assert torch.allclose(eager.float(), fused.float(), rtol=2 ** -7, atol=1e-6)


async def test_the_checkpoint_store_resumes_the_run_bit_for_bit(tmp_path: Path) -> None:
    from asyncrl.checkpoint import CheckpointConfig, Checkpointer, TrainingState, restore
    from asyncrl.counters import GroupTotals

    def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, StochasticAdamW]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).bfloat16()
        return model, StochasticAdamW(model.parameters(), lr=1e-4, weight_decay=0.1, seed=seed)

    x = torch.randn(32, 16).bfloat16()

    model, opt = model_and_optimizer(seed=11)
    fit(model, opt, x, 2)
    async with Checkpointer(CheckpointConfig(dir=tmp_path)) as ckpt:
        saved = await ckpt.save(model, opt, TrainingState(step=2, version=2, published=True, cursor=0,
                                                          counters=GroupTotals()))
    fit(model, opt, x, 3)
    again, fresh = model_and_optimizer(seed=99)  # the seed, like the step counts, comes from the checkpoint
    restore(saved, again, fresh)
    assert fresh.param_groups[0]["seed"] == 11
    assert all(v.dtype == torch.bfloat16 for s in fresh.state.values() for k, v in s.items() if k != "step")
    fit(again, fresh, x, 3)
    for p, q in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q)


def test_fsdp2_shards_train_as_the_plain_model_and_resume_from_a_sharded_checkpoint(tmp_path: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from asyncrl.distributed.checkpoint import load_sharded, save_sharded

    def make() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Linear(32, 3)).bfloat16()

    x = torch.randn(4, 8).bfloat16()

    plain = make()
    plain_opt = StochasticAdamW(plain.parameters(), lr=1e-3, seed=4)
    fit(plain, plain_opt, x, 4)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = fully_shard(make(), mesh=mesh)
        opt = StochasticAdamW(sharded.parameters(), lr=1e-3, seed=4)
        fit(sharded, opt, x, 2)
        assert all(isinstance(v, DTensor) and v.dtype == torch.bfloat16
                   for s in opt.state.values() for k, v in s.items() if k != "step")
        save_sharded(tmp_path / "ckpt", sharded, opt, {"step": 2})
        resumed = fully_shard(make(), mesh=mesh)
        resumed_opt = StochasticAdamW(resumed.parameters(), lr=1e-3, seed=0)
        load_sharded(tmp_path / "ckpt", resumed, resumed_opt)
        fit(resumed, resumed_opt, x, 2)
        for p, q in zip(plain.parameters(), resumed.parameters(), strict=True):
            assert torch.equal(p, q.full_tensor())
    finally:
        dist.destroy_process_group()


def test_the_config_chooses_and_the_optimiser_refuses_what_it_cannot_keep() -> None:
    model = torch.nn.Linear(4, 4).bfloat16()
    chosen = default_optimizer(model, LearnerConfig(optimizer="adamw_bf16", lr=2e-6, weight_decay=0.01))
    assert isinstance(chosen, StochasticAdamW) and not chosen.compiled
    assert default_optimizer(model, LearnerConfig(optimizer="adamw_bf16", compile_elementwise=True)).compiled
    assert chosen.param_groups[0]["lr"] == 2e-6 and chosen.param_groups[0]["weight_decay"] == 0.01
    assert type(default_optimizer(model, LearnerConfig())) is torch.optim.AdamW  # bf16 under "adamw": allowed
    assert isinstance(default_optimizer(torch.nn.Linear(2, 2), LearnerConfig(optimizer="adamw_bf16")),
                      StochasticAdamW)  # float32 under "adamw_bf16": allowed, exact
    with pytest.raises(ConfigError) as err:
        LearnerConfig(optimizer="adam8bit")  # type: ignore[arg-type]
    assert err.value.field == "LearnerConfig.optimizer"
    with pytest.raises(ValueError, match="torch.float16"):
        StochasticAdamW(torch.nn.Linear(2, 2).half().parameters())
    with pytest.raises(ValueError, match="lr=-1"):
        StochasticAdamW(model.parameters(), lr=-1.0)
