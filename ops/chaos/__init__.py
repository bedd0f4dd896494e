"""The hostile-client battery behind ``flare bench chaos``.

``cases`` builds the bad-input requests (bytes as sent on the wire), ``wire`` is a
minimal HTTP/1.x client over raw sockets (so that malformed requests reach the server
exactly as built), ``server_process`` reads a server's RSS, descriptors and TCP sockets
from ``/proc``, ``phases`` runs the battery, the disconnect storm, the overload burst,
the slow readers, the maximal-body abuse with its probe stream, the soak and the idle
keep-alive check, and ``report`` turns their figures into a table, JSON and verdicts.
"""
