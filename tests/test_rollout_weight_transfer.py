"""Weight transfer to an engine apart from the trainer (megagrpo/rollout/weight_transfer.py): a
real `vllm serve` of the tiny model started here, sharded over 2 workers (tensor parallel), with
weight-transfer backend "gloo" (registered in its workers by megagrpo's vLLM plugin entry
point); the trainer's whole tensors sent twice through vLLM's trainer engine factory and the
server's RL endpoints (tests/helpers/transfer_probe.py), each worker loading its shard. After
each update the server's log-probs equal the trainer's, and it names the version."""
import json
import os
import sys

import pytest
from conftest import PYTHON, run

from megagrpo.rollout.servers import Server, ServerError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "helpers"))
import daemons  # noqa: E402


@pytest.mark.daemons
def test_weights_sent_to_a_sharded_vllm_server_over_gloo(tiny, tmp_path):
    with daemons.vllm_server(tiny["warm"], tmp_path, "--weight-transfer-config", '{"backend": "gloo"}',
                             "--tensor-parallel-size", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as url:
        proc = run([PYTHON, "tests/helpers/transfer_probe.py", "--url", url, "--model", tiny["warm"]], timeout=300)
        # without --enable-scale-out it has no token route, which partial rollouts need: said at start
        with pytest.raises(ServerError, match="restart it with --enable-scale-out"):
            Server(url, timeout_s=30, retries=0).check_token_route()
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["before"] < 1e-4, result  # the server and the trainer start from the same weights
    assert [u["version"] for u in result["updates"]] == ["1", "2"], result
    for update in result["updates"]:
        assert update["moved"] > 1e-2, result  # each update changes what the server must answer
        assert update["gap"] < 1e-4, result    # and it answers as the trainer's weights do
