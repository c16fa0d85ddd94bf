"""Plain pieces every process shares: what ranks report (``events``), fault injection, the log format,
how a location is spelled, private folders. Imports nothing else of the package.
"""
