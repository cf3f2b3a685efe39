"""flowrl inside verl 0.9.1 (``pip install verl==0.9.1``; see docs/verl.md).

* :func:`to_dataproto` / :func:`from_dataproto`: a :class:`~flowrl.Batch` as a verl
  ``DataProto`` and back, lossless, in verl's padded worker layout or without padding;
  any DataProto verl built goes in too.
* :func:`ack_dataproto` / :func:`dataproto_claims`: settle the claims the rows of a
  DataProto came from (verl's ``concat`` joins batches of several claims).
* :class:`DataProtoLoader`: DataProtos of whole GRPO groups whose size the data-parallel
  world divides (verl's ``chunk`` never raises "only support equal chunk").
* :class:`HubAgentLoopManager`: ``actor_rollout_ref.rollout.agent.agent_loop_manager_class``
  that serves ``generate_sequences`` from the hub: the groups asked for with their uids
  (or the oldest complete ones, carrying unfinished groups over), validation apart.

verl's V1 trainer (TransferQueue underneath) meets flowrl in :mod:`flowrl.integrations.verl_v1`.

verl is imported when one of these is used, never by ``import flowrl``; each checks that
the installed verl is the supported release (:data:`SUPPORTED_VERL`).
"""

from flowrl.integrations._dataproto import Layout, from_dataproto, to_dataproto
from flowrl.integrations._dataproto_rows import ack_dataproto, dataproto_claims
from flowrl.integrations._verl_batches import DataProtoLoader, DataProtoLoaderStats
from flowrl.integrations._verl_compat import SUPPORTED_VERL, require_verl
from flowrl.integrations._verl_manager import HubAgentLoopManager

__all__ = [
    "SUPPORTED_VERL",
    "DataProtoLoader",
    "DataProtoLoaderStats",
    "HubAgentLoopManager",
    "Layout",
    "ack_dataproto",
    "dataproto_claims",
    "from_dataproto",
    "require_verl",
    "to_dataproto",
]
