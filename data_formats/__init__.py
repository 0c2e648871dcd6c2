"""Relay data formats: reading, validation, rendering with exact loss masks, packing, multitask.

python -m data_formats.validate --kind sft FILE...     # FILE:LINE: reason for every bad record
python -m data_formats.show FILE --template role_markers   # coloured view of trained tokens
"""
