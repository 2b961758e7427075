"""Sans-I/O MQTT 3.1.1 and 5.0 protocol: packets, codec, validation, connection state.

Nothing in this package performs I/O, reads a clock or starts a task: bytes go in through
``receive_data()``, events come out of ``events_received()``, bytes to write come out of
``data_to_send()``, and time is passed in as an argument where it matters.
"""
