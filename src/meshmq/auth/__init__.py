"""Who may connect: password files with argon2id hashes (and, later, ACLs and TLS identities)."""
