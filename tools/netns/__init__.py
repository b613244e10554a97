"""Several hosts on one machine (network namespaces on a bridge) and a moonbus cluster spread over
them: tests/integration/test_hosts.py runs the README's Production layout through it."""
