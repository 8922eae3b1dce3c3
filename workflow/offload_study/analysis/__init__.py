"""Stage 4, analyze: run records become tables and a report.

``collect`` (runs.csv, summary.csv with bootstrap CIs and paired ratios), ``sanity`` (ReFrame-style
checks over records, kept in tables) and ``report`` (the HTML report and its figures).
"""
