"""Sharded deduplication: one deduplication spread over many processes (docs/scale-out.md).

The LSH band buckets are the state that grows with the index, so they are sharded by
bucket id, as Kafka Streams shards a keyed store by key: each shard partition owns the
buckets whose id maps to it (``routing.shard_of``), with the shingle sets of the
documents it holds there, and answers for its buckets alone (``shard.ShardIndex``). A
document's verdict is assembled from the answers of every shard it touched
(``decide.decide``). ``reference.run_sharded`` runs all of it in one process, in order:
the model the Kafka stages are checked against, and the measure of how far the sharded
rule's verdicts are from one process's.

The three Kafka stages run these rules on the exactly-once runtime (``neardup.kafka``):
``prepare_stage``, ``shard_stage`` and ``decide_stage``, over the internal topics of
``topology``.
"""
