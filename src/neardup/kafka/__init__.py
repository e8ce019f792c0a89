"""The exactly-once Kafka runtime: the transactional stage loop (``stage``), its clients and
their settings (``clients``, ``kafka_config``, ``limits``, ``bounded``, ``rdkafka_log``),
the state's changelog and the restore from it (``changelog``, ``partition_log``,
``state_check``), the ordered intake across input partitions (``intake``), topics
(``topics``), progress for ``/readyz`` (``progress``), Kafka messages to documents and
verdicts to headers (``messages``), and ``neardup produce`` (``produce``).

It knows nothing of what a stage computes: the single-process deduplication
(``neardup.run``) and the sharded stages (``neardup.sharded``) run on it.
"""
