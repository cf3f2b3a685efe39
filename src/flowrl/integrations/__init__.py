"""Bridges to the RL frameworks flowrl embeds in; each is imported on demand.

* :mod:`flowrl.integrations.verl` — verl 0.9.1: ``DataProto`` conversion, batches that split
  evenly over data-parallel ranks, an agent-loop manager served from the hub.
* :mod:`flowrl.integrations.verl_v1` — verl 0.9.1's V1 trainer on the TransferQueue-compatible
  client, and replay buffers for its ``custom_sampler`` that wake on the hub's events.
* :mod:`flowrl.integrations.slime` — slime: ``Sample``-shaped rows, a ``DataSource`` and a
  rollout function backed by the hub (duck-typed: slime is never imported).

Importing this package imports neither verl nor slime.
"""
