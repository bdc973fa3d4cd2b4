"""What is stored and what was done, as tenants look it up: checkpoints and `tinker://` paths in
the catalogue (`catalog`), signed downloads of their files (`downloads`), the retained operation
events (`events`), and what is folded from them: usage, the audit log and session timelines
(`metering`), encoded as Perfetto traces (`perfetto`)."""
