"""Rollout data in files: the rollout dump (its format, writer, reader, checks, and a data-parallel rank's
share of it), JSONL lines read with their place named, and tool outputs written without destroying a file.
"""
