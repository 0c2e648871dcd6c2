"""What a user runs around the stages: the pipeline driver, the report, chat, the `relay`
command and the gold table. Tools run stages as processes (through the registry in
stages/__init__.py) and read what stages write; nothing below imports them."""
