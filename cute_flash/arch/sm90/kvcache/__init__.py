"""The sm90 KV-cache forward (serving: decoding and chunked prefill against a dense or paged K / V cache): its kernel,
a subclass of the bf16 forward that replaces the producer and CTA side (`flash_fwd`), the producer's paged TMA
loads and the query-row loads (`loads`), the packed-row epilogue (`epilogue`), tile configurations and split counts
(`tile_config`) and the host-side launch (`launch`). The same file names as the arch package itself, one level down
(as `fp8/`)."""
