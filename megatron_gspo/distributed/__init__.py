"""The parallel layout and its process groups (``parallel``), small collectives on device
tensors (``comm``), and sequences split over context-parallel ranks (``seqshard``)."""
