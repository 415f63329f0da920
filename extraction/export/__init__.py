"""The SpecForge view (`hsx export-view`): finished shards as a tree of links a trainer reads.

view: verify the outputs, number the samples, commit mapping then links; links: the link tree in
DEST; mapping: DEST/export.json and DEST/mapping.jsonl; report: what an export run did.
"""
