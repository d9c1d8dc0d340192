"""The topology's rank arithmetic against DeepSpeed's own topologies (the layouts AutoTP and
PipelineModule use), for every rank of several worlds."""
import pytest
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

from megagrpo.cluster.topology import Topology


def groups_of(topology, axis):
    return sorted(sorted(g) for g in topology.get_axis_comm_lists(axis))


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (4, 1, 1), (2, 2, 1), (4, 2, 1), (8, 4, 1),
                                         (2, 1, 2), (4, 1, 2), (6, 1, 3), (8, 1, 4),
                                         (4, 2, 2), (8, 2, 2), (16, 2, 4), (12, 2, 3)])
def test_groups_match_deepspeed(world, tp, pp):
    """Ours against DeepSpeed's (pipe, data, model) topology, the one PipelineModule gets (and,
    with pp 1, AutoTP's (dp, tp) mesh; with tp 1, the (pipe, data) default)."""
    dp = world // (tp * pp)
    reference = PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp)
    if tp == 1:  # the default topology of a PipelineModule: the same layout
        default = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
        assert all(default.get_rank(pipe=c.pipe, data=c.data) == r
                   for r, c in enumerate(map(reference.get_coord, range(world))))
    coords = {r: reference.get_coord(r) for r in range(world)}
    replicas = sorted(sorted(r for r in range(world) if coords[r].data == d) for d in range(dp))
    tp_groups = groups_of(reference, "model") or [[r] for r in range(world)]
    dp_groups = groups_of(reference, "data") or [[r] for r in range(world)]
    places = [Topology(world, r, 0, tp, pp) for r in range(world)]
    assert sorted({tuple(sorted(p.model_ranks())) for p in places}) == [tuple(g) for g in replicas]
    assert sorted({tuple(sorted(p.dp_ranks())) for p in places}) == [tuple(g) for g in dp_groups]
    assert sorted({tuple(p.stage_ranks(p.pp_rank)) for p in places}) == [tuple(g) for g in tp_groups]
    for p in places:
        coord = coords[p.rank]
        assert (p.dp_rank, p.pp_rank, p.tp_rank) == (coord.data, coord.pipe, coord.model)
        assert p.rank_of(p.pp_rank, p.dp_rank, p.tp_rank) == p.rank
        assert p.rank in p.model_ranks() and p.rank in p.dp_ranks()
        assert p.model_ranks() == [r for s in range(pp) for r in p.stage_ranks(s)]  # stage by stage
        assert p.model_group_source == p.model_ranks()[0]
        assert p.samples_rollout == (p.tp_rank == 0 and p.pp_rank == 0)
        assert p.dp_ranks()[p.dp_rank] == p.rank


@pytest.mark.parametrize("world,tp,pp,generator_tp", [(4, 2, 1, 2), (4, 1, 1, 2), (8, 2, 1, 4), (8, 4, 1, 2),
                                                      (8, 2, 1, 8), (4, 2, 2, 1), (4, 1, 1, 1), (4, 2, 1, 1)])
def test_generator_groups(world, tp, pp, generator_tp):
    """Generator groups are blocks of consecutive ranks (vLLM's tp groups under the external
    launcher). Each model group's rollout comes from the ranks whose block holds the group's
    first rank; the ranks of a block lie in one trainer tp group or cover whole ones, so a block
    pools whole dp replicas; the ranks that sample nothing get the rollout from the source."""
    places = [Topology(world, r, 0, tp, pp, generator_tp=generator_tp) for r in range(world)]
    for p in places:
        block = p.generator_ranks()
        assert block == list(range(block[0], block[0] + generator_tp)) and block[0] % generator_tp == 0
        assert p.rank in block and all(places[r].generator_ranks() == block for r in block)
        replicas = {places[r].dp_rank for r in block}
        tp_groups = {tuple(places[r].stage_ranks(places[r].pp_rank)) for r in block}
        assert len(replicas) == 1 or all(set(g) <= set(block) for g in tp_groups)  # whole replicas
        sampling_block = places[p.model_group_source].generator_ranks()
        assert p.generates == (p.rank in sampling_block)
        model = p.model_ranks()
        assert p.shares_rollout == (len(model) > 1 and not all(places[q].generates for q in model))


@pytest.mark.parametrize("world,sp", [(2, 2), (4, 2), (8, 4), (8, 2)])
def test_sequence_parallel_groups_are_deepspeeds(world, sp):
    """The sp groups as DeepSpeed's `parallel_state_sp` forms them (blocks of sp consecutive
    ranks, which the engine reduces over); a replica (model group) is one sp group, its first
    rank alone samples and shares the rollout, dp ranks hold the same slice of other prompts."""
    places = [Topology(world, r, 0, sp_size=sp) for r in range(world)]
    blocks = [list(range(first, first + sp)) for first in range(0, world, sp)]
    assert sorted({tuple(p.model_ranks()) for p in places}) == [tuple(b) for b in blocks]
    for p in places:
        assert (p.dp_size, p.dp_rank, p.sp_rank, p.tp_rank, p.pp_rank) == (world // sp, p.rank // sp, p.rank % sp, 0, 0)
        assert p.rank_of(0, p.dp_rank, 0, p.sp_rank) == p.rank
        assert p.dp_ranks() == [d * sp + p.sp_rank for d in range(world // sp)]
        assert p.generates == p.samples_rollout == (p.sp_rank == 0) and p.shares_rollout
        assert f"dp {world // sp} x sp {sp} x tp 1" in p.describe()
