"""What the daemon and the client both run: the shared half of tableserver.

``buffers`` (page-placed row buffers), ``take`` (the bounds-checked row gather, native in ``_take.c``),
``wire`` (the tcp and shm framing), ``seal`` (AES-GCM sealing of tcp payloads), ``verbs`` (pyverbs
resources: devices, MRs, RC QPs, with their own errno-carrying errors), ``recorder`` (latency histograms),
``host`` (this host's identity, which decides whether shm can reach a server; its /proc figures), ``model``
(DeepSeek-V4.1's Engram facts: row bytes, rows per token, layer windows) and ``hostmem`` (where each engine keeps
the tables and what that takes per process and per host: ``tableserver plan`` and the plugins' memory report).
Nothing here imports the daemon (``tableserver.*`` outside ``common`` and ``v1``) or the client; the import
contract in setup.cfg checks it.
"""
