"""The topology's rank arithmetic against DeepSpeed's own topologies (the layouts AutoTP and
PipelineModule use), for every rank of several worlds."""
import pytest
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

from megagrpo.cluster.topology import Topology


def groups_of(topology, axis):
    return sorted(sorted(g) for g in topology.get_axis_comm_lists(axis))


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (4, 1, 1), (2, 2, 1), (4, 2, 1), (8, 4, 1),
                                         (2, 1, 2), (4, 1, 2), (6, 1, 3), (8, 1, 4)])
def test_groups_match_deepspeed(world, tp, pp):
    dp = world // (tp * pp)
    if pp > 1:
        reference = PipeDataParallelTopology(num_pp=pp, num_dp=dp)
        model_axis = "pipe"
    else:
        reference = PipeModelDataParallelTopology(num_pp=1, num_mp=tp, num_dp=dp)
        model_axis = "model"
    model_groups = groups_of(reference, model_axis) or [[r] for r in range(world)]
    dp_groups = groups_of(reference, "data") or [[r] for r in range(world)]
    places = [Topology(world, r, 0, tp, pp) for r in range(world)]
    assert sorted({tuple(p.model_ranks()) for p in places}) == [tuple(g) for g in model_groups]
    assert sorted({tuple(sorted(p.dp_ranks())) for p in places}) == [tuple(g) for g in dp_groups]
    for p in places:
        coord = reference.get_coord(p.rank)
        assert p.dp_rank == coord.data
        assert p.pp_rank == coord.pipe
        assert p.tp_rank == (coord.model if pp == 1 else 0)
        assert p.rank in p.model_ranks() and p.rank in p.dp_ranks()
        assert p.model_group_source == p.model_ranks()[0]
        assert p.samples_rollout == (p.tp_rank == 0 and p.pp_rank == 0)
        assert p.dp_ranks()[p.dp_rank] == p.rank
