"""What is stored and what was done, as tenants look it up: checkpoints and `tinker://` paths in
the catalogue (`catalog`), signed downloads of their files (`downloads`), and what is folded from
the operation events: usage, the audit log and session timelines (`metering`), encoded as
Perfetto traces (`perfetto`)."""
