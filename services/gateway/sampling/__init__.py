"""How a sample runs once accepted: the shared job queue's runner (`sample_runner`), the engines
and the adapters they hold (`engines`, over SGLang's HTTP API: `sglang`), which base models can be
sampled here (`sampleable`), and the recorded samples `stable_reinforce` trains on
(`stability`)."""
