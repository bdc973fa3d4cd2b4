"""What the SDK and the admin API send and read, and how: the SDK's JSON shapes (`tinker_wire`),
its protobuf messages (`tinker_public.proto`, generated into `tinker_public_pb2`, checked by
`proto`), the admin and account shapes (`admin_wire`), wire datums turned into bus datums
(`validation`), and results rendered as the client's `Accept` asks (`render`)."""
