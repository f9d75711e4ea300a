"""The video DiT under sequence parallelism equals the same DiT on one rank, and its checkpoints round-trip.

The model (``examples/sp_recipes/video_dit.py``) shards its video tokens over the SP group and gathers the
prediction, so every SP rank holds the same loss; upstream's collective gradients (the gather's backward sums over
SP ranks, the shard's divides by the SP size) make the SP ranks' parameter gradients sum to SP size x the
single-device gradient. Checked in float64 against one rank at SP2, SP3 (80 video tokens: uneven shares, or padded
with ``seq_shard="pad"``) and SP4 (6 heads: uneven head shares), and with a negative control (each rank's own
gradient alone is not the single-device one, so the check is not vacuous). Checkpoints: saved from an FSDP2 model
on 2 ranks, loaded into fresh models on 2 ranks and on 1 rank.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed.mp import run_ranks


def _dit_step(rank, world_size, seq_shard="uneven"):
    import torch.distributed as dist

    from fastvideo.distributed.parallel_state import get_sp_group
    from sp_recipes.data import SyntheticVideoLatents
    from sp_recipes.video_dit import CONFIGS, VideoDiT, flow_matching_loss

    cfg = CONFIGS["tiny"]
    torch.manual_seed(0)
    model = VideoDiT(cfg, seq_shard=seq_shard).double()
    batch = SyntheticVideoLatents(cfg).batch(1, batch_size=2)
    xt = batch.xt.double()
    loss = flow_matching_loss(model(xt, batch.t.double(), batch.text.double()), batch.x0.double(),
                              batch.noise.double())
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    own = grads.clone()
    if world_size > 1:
        dist.all_reduce(grads, group=get_sp_group().device_group)
    # numpy, not tensors: the harness's queue would pass tensors as shared memory the rank frees on exit
    return loss.item(), (grads / world_size).numpy(), own.numpy()


@pytest.mark.parametrize("world_size,seq_shard", [(2, "uneven"), (3, "uneven"), (3, "pad"), (4, "uneven")])
def test_the_dit_under_sp_equals_the_dit_on_one_rank(world_size, seq_shard):
    (ref_loss, ref_grads, _), = run_ranks(1, _dit_step)
    ref_grads = torch.from_numpy(ref_grads)
    for loss, grads, own in run_ranks(world_size, _dit_step, seq_shard, timeout_s=120):
        grads, own = torch.from_numpy(grads), torch.from_numpy(own)
        assert loss == pytest.approx(ref_loss, rel=1e-12, abs=0)
        torch.testing.assert_close(grads, ref_grads, rtol=1e-9, atol=1e-12)
        # Negative control: one rank's own gradient is a partial one; only their sum over ranks is the gradient.
        assert (own - ref_grads).abs().max() > 1e-6


def _save(rank, world_size, path):
    from sp_recipes.checkpoint import save_checkpoint
    from sp_recipes.data import SyntheticVideoLatents
    from sp_recipes.fsdp import shard_dit, world_mesh
    from sp_recipes.video_dit import CONFIGS, VideoDiT, flow_matching_loss

    cfg = CONFIGS["tiny"]
    torch.manual_seed(0)
    model = VideoDiT(cfg)
    shard_dit(model, world_mesh(torch.device("cpu")), blocks=model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = SyntheticVideoLatents(cfg).batch(1, batch_size=2)
    flow_matching_loss(model(batch.xt, batch.t, batch.text), batch.x0, batch.noise).backward()
    opt.step()
    save_checkpoint(path, model, opt, step=7, metadata={"config": cfg.to_dict()})
    return {n: p.full_tensor().detach().numpy().copy() for n, p in model.named_parameters()}


def _load(rank, world_size, path, sharded):
    from sp_recipes.checkpoint import load_checkpoint
    from sp_recipes.fsdp import shard_dit, world_mesh
    from sp_recipes.video_dit import CONFIGS, VideoDiT, VideoDiTConfig

    cfg = CONFIGS["tiny"]
    torch.manual_seed(1)  # other initial weights: everything must come from the file
    model = VideoDiT(cfg)
    if sharded:
        shard_dit(model, world_mesh(torch.device("cpu")), blocks=model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step, meta = load_checkpoint(path, model, opt)
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy()
              for n, p in model.named_parameters()}
    states = sorted(opt.state_dict()["state"][0])
    missing = None
    try:
        load_checkpoint(str(path) + ".missing", model, opt)
    except ValueError as exc:
        missing = str(exc)
    return step, VideoDiTConfig.from_dict(meta["config"]) == cfg, params, states, missing


def test_checkpoints_round_trip_across_world_sizes(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    saved = run_ranks(2, _save, str(path))[0]
    assert path.is_file()
    for world_size, sharded in ((2, True), (1, False)):
        for step, same_config, params, states, missing in run_ranks(world_size, _load, str(path), sharded):
            assert step == 7 and same_config
            assert params.keys() == saved.keys()
            assert all((params[n] == saved[n]).all() for n in saved)
            assert states == ["exp_avg", "exp_avg_sq", "step"]
            assert missing is not None and "cannot read" in missing


def _prepare(rank, world_size, path):
    from sp_recipes.loop import prepare_training
    from sp_recipes.video_dit import CONFIGS, VideoDiT, VideoDiTConfig

    cfg = CONFIGS["tiny"]
    device = torch.device("cpu")
    fresh = prepare_training(VideoDiT(cfg), device, lr=1e-3, resume=None, resume_problem=lambda meta: "unused")[1]
    step = prepare_training(VideoDiT(cfg), device, lr=1e-3, resume=path, resume_problem=lambda meta: (
        None if VideoDiTConfig.from_dict(meta["config"]) == cfg else "another config"))[1]
    refused = None
    try:  # the control: a checkpoint the recipe says is not its model's
        prepare_training(VideoDiT(cfg), device, lr=1e-3, resume=path, resume_problem=lambda meta: "another model")
    except ValueError as exc:
        refused = str(exc)
    return fresh, step, refused


def test_prepare_training_resumes_a_checkpoint_of_its_model_and_refuses_another(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    run_ranks(2, _save, str(path))
    for fresh, step, refused in run_ranks(2, _prepare, str(path)):
        assert fresh == 0 and step == 7
        assert refused == f"--resume {path}: another model."
