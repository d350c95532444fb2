"""Fault tolerance across replica groups (fault_tolerance.*): the groups' quorum and gradient
exchange on torchft (replica_groups.py), the live state a rejoining group fetches (transport.py)
and what a group believes of its peers (trust.py), the lighthouse that forms each quorum
(lighthouse.py, lighthouse_server.py, lighthouse_wire.py, quorum.py), and the network and secret
rules the launcher checks before any worker starts (network.py)."""
