"""Unified-memory guards for a node whose GPU allocates from the memory the OS needs (DGX Spark):
per-phase memory lines (`memlog`), allocator release between long prefill chunks through vLLM hooks (`hooks`),
page-cache drop after loading (`pagecache`) and the boot margin check (`margin`)."""
