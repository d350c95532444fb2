"""The messages of torchft's lighthouse protocol (gRPC service `torchft.LighthouseService`), as
torchft 0.2.0's managers send and read them, built at import from their field numbers (torchft's
`proto/torchft.proto`; the wheel ships no Python messages for it, and no protoc is needed).

Only the lighthouse's own service is here: `Quorum` (a group's request to join the next quorum,
answered with that quorum) and `Heartbeat`. The descriptors live in a pool of their own, so a
process that also loads another copy of torchft's messages sees no clash.
"""

from __future__ import annotations

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2

SERVICE = "torchft.LighthouseService"

_F = descriptor_pb2.FieldDescriptorProto
_MESSAGES: dict[str, list[tuple[str, int, int, str, bool]]] = {
    # name: [(field, number, type, message type name, repeated)]
    "QuorumMember": [
        ("replica_id", 1, _F.TYPE_STRING, "", False),
        ("address", 2, _F.TYPE_STRING, "", False),
        ("store_address", 3, _F.TYPE_STRING, "", False),
        ("step", 4, _F.TYPE_INT64, "", False),
        ("world_size", 5, _F.TYPE_UINT64, "", False),
        ("shrink_only", 6, _F.TYPE_BOOL, "", False),
        ("data", 7, _F.TYPE_STRING, "", False),
        ("commit_failures", 8, _F.TYPE_INT64, "", False),
    ],
    "Quorum": [
        ("quorum_id", 1, _F.TYPE_INT64, "", False),
        ("participants", 2, _F.TYPE_MESSAGE, ".torchft.QuorumMember", True),
        ("created", 3, _F.TYPE_MESSAGE, ".google.protobuf.Timestamp", False),
    ],
    "LighthouseQuorumRequest": [("requester", 1, _F.TYPE_MESSAGE, ".torchft.QuorumMember", False)],
    "LighthouseQuorumResponse": [("quorum", 1, _F.TYPE_MESSAGE, ".torchft.Quorum", False)],
    "LighthouseHeartbeatRequest": [("replica_id", 1, _F.TYPE_STRING, "", False)],
    "LighthouseHeartbeatResponse": [],
}


def _classes() -> dict[str, type]:
    pool = descriptor_pool.DescriptorPool()
    pool.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)
    file = descriptor_pb2.FileDescriptorProto(
        name="distrain/torchft_lighthouse.proto",
        package="torchft",
        syntax="proto3",
        dependency=["google/protobuf/timestamp.proto"],
    )
    for name, fields in _MESSAGES.items():
        message = file.message_type.add(name=name)
        for field, number, kind, type_name, repeated in fields:
            label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
            added = message.field.add(name=field, number=number, type=kind, label=label)
            if type_name:
                added.type_name = type_name
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"torchft.{name}"))
        for name in _MESSAGES
    }


_CLASSES = _classes()
QuorumMember = _CLASSES["QuorumMember"]
Quorum = _CLASSES["Quorum"]
LighthouseQuorumRequest = _CLASSES["LighthouseQuorumRequest"]
LighthouseQuorumResponse = _CLASSES["LighthouseQuorumResponse"]
LighthouseHeartbeatRequest = _CLASSES["LighthouseHeartbeatRequest"]
LighthouseHeartbeatResponse = _CLASSES["LighthouseHeartbeatResponse"]
