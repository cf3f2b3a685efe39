"""The hub's commands, each defined once as a tagged ``msgspec.Struct``.

A command is what a client asks of the controller (reserve, commit, claim, ack, ...). The
same Struct is built by the client, handed to the in-process controller as it is, sent
over zmq by the same encoder (``codec``), decoded and validated by the controller server,
and rebuilt from the journal's events on replay. Sample arrays are int64 numpy arrays in
memory and raw bytes on the wire (``codec.Int64s``).

This layer sits below ``_controller``, ``_store`` and ``_client``: it imports only numpy,
msgspec, ``flowrl.errors`` and ``flowrl._schema``.
"""
