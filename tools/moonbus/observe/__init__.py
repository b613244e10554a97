"""Reading what the cluster did, from its event stream (the audit log).

    tap.py     `moonbus tap`: the stream live, by kind or request id
    audit.py   `moonbus audit`: prove the log complete and unaltered, or show one request's record
    escape.py  what an event says, made safe to print (control characters escaped)
"""
