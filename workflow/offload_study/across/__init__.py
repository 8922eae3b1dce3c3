"""Stage 5, across clusters: a study's records packed as a bundle (``bundle``), bundles
compared side by side (``compare``), checked against references (``check``), and published as a
site (``site``).
"""
