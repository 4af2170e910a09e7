"""A step's batch: the rollout's rows (``rollout_batch``), their layouts in micro-batches (padded
or packed, ``layout``), the micro-batches the model is fed (``micro_batch``), packing's plan and
its exchange of rows between data-parallel ranks (``packing``, ``exchange``)."""
