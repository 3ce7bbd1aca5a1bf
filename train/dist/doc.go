// Package dist makes the processes of one training job a group: where
// each process stands (its rank, from the launcher's environment), the
// rendezvous at rank 0 that admits the others, the control plane that
// keeps them connected after it (heartbeats, a barrier, a small
// broadcast, failure), and a launcher of the ranks on one node. It moves
// no tensors: the collectives of data-parallel training are NCCL's
// (issue 25), and NCCL's unique id is what the rendezvous hands out.
//
// # Environment
//
// Env (FromEnv, Discover) is read from the first launcher whose
// variables are set:
//
//   - torchrun, and Launch: RANK and WORLD_SIZE; with WORLD_SIZE > 1 also
//     LOCAL_RANK, MASTER_ADDR and MASTER_PORT, and LOCAL_WORLD_SIZE when
//     set.
//   - srun (Slurm): SLURM_PROCID and SLURM_NTASKS; with SLURM_NTASKS > 1
//     also SLURM_LOCALID; rank 0's host is MASTER_ADDR if set, else the
//     first host of SLURM_STEP_NODELIST, SLURM_JOB_NODELIST or
//     SLURM_NODELIST (the first set), in Slurm's compressed syntax
//     ("node[01-04,07],gpu5" gives node01); the port is MASTER_PORT if
//     set, else 15000 + FNV-1a("SLURM_JOB_ID.SLURM_STEP_ID") mod 17000
//     (SlurmPort), the same on every node. SLURM_STEP_TASKS_PER_NODE or
//     SLURM_TASKS_PER_NODE ("2(x3),1") with SLURM_NODEID give
//     LOCAL_WORLD_SIZE when set.
//   - neither: one process, world size 1, no rendezvous.
//
// A variable missing or malformed is an ErrEnv naming it. Launch also
// sets DISTILL_RDZV_REPORT_FD (every rank) and DISTILL_RDZV_LISTEN_FD
// (rank 0), described below. The rendezvous token is read by
// TokenFromEnv: the file DISTILL_RDZV_TOKEN_FILE names (read as teacherd's
// --token-file is), or DISTILL_RDZV_TOKEN; not both.
//
// # Rendezvous
//
// Rank 0 listens on TCP at MASTER_ADDR:MASTER_PORT (or on the socket
// inherited at DISTILL_RDZV_LISTEN_FD); every other rank connects,
// retrying with backoff (50 ms doubling to 2 s) until the join timeout
// (Options.JoinTimeout, default 5 min). On the wire every message is a
// frame: its length as 4 bytes big endian, then a JSON object whose "type"
// says which fields it has (at most 4 MiB before the token is checked, 16
// MiB after):
//
//	0 -> r  challenge  proto "distill-rdzv/1", nonce (32 random bytes)
//	r -> 0  hello      proto, rank, world_size, nonce (the member's own),
//	                   mac = HMAC-SHA256(token, "distill-rdzv/1 client\x00" || rank 0's nonce),
//	                   config_hash, config: {key: first 32 hex digits of SHA-256(value)}
//	0 -> r  welcome    world_size, config_hash, unique_id, heartbeat_ms,
//	                   mac = HMAC-SHA256(token, "distill-rdzv/1 server\x00" || the member's nonce)
//	0 -> r  refuse     error, key (the config key it concerns), op (the cause:
//	                   "token", "config" or "rendezvous")
//
// ([]byte fields are base64, as encoding/json writes them.) The token
// never travels: each side proves it knows it, and compares the other's
// proof in constant time (hmac.Equal). The config is the resolved config
// flattened to dotted keys (FlattenConfig); the config hash is the
// SHA-256 of its sorted keys with their digests. Values do not travel
// either: a refusal names the key and rank 0's value, and each side adds
// its own.
//
// Rank 0 answers the welcomes only when every rank has joined, so a
// returned Join means the whole world is there. It refuses:
//
//   - a wrong, missing or unexpected token: that connection only, the
//     rendezvous goes on (a stranger cannot abort a job);
//   - a world size other than its own, a rank outside 1..world-1, a
//     rank already joined (or a second rank 0), a config whose digests
//     differ (the message names the first differing key in sorted order):
//     the rendezvous is aborted, the offender gets a refuse saying why and
//     every rank admitted so far a refuse saying "rendezvous aborted by
//     rank 0: ..."; a rank that comes later finds no listener and fails
//     at its join timeout (or when its launcher stops it);
//   - an admitted rank whose connection drops, or the join timeout,
//     which names the ranks missing: aborted the same way.
//
// # Security
//
// A rank 0 whose bound address is not loopback (a host name, an
// interface address, 0.0.0.0) refuses to start without a token
// (ErrInsecure), naming the fix: the same DISTILL_RDZV_TOKEN_FILE (or
// DISTILL_RDZV_TOKEN) on every rank, or MASTER_ADDR=127.0.0.1 on one node.
// On loopback a token is optional; when rank 0 has one every member needs
// it, and a member with one refuses a rank 0 that cannot prove it (another
// job's rendezvous on the same port). The frames are not encrypted: the
// token keeps strangers out, it does not hide the unique id or the
// config's digests from someone who can read the network.
//
// # Control plane and failure
//
// After the welcome the connections stay open, one from each rank to
// rank 0, with these frames:
//
//	both    heartbeat                  every heartbeat timeout / 5
//	r -> 0  enter    seq, op ("barrier" or "broadcast"), root, data (on the root)
//	0 -> r  release  seq, data (the root's, for a broadcast)
//	both    abort    rank (the one that failed, -1 when none), error
//	both    bye      (Close: no one takes this rank for dead)
//
// Collectives (Barrier, Broadcast) complete when every rank has entered
// them; every rank must call them in the same order, and a rank calling
// another one fails the group. A broadcast goes through rank 0, as JSON:
// it is for small messages.
//
// A rank that dies fails the whole job within a bounded time, naming it:
// its connection closing without a bye is seen at once; a rank that hangs
// or loses the network is declared dead when nothing, not even a
// heartbeat, came from it for the heartbeat timeout (rank 0's
// Options.HeartbeatTimeout, default 30 s, checked every fifth of it).
// Rank 0 then sends every other rank an abort naming the rank, and every
// rank's group ends: Done is closed, Err and every collective return a
// *RankError (errors.Is ErrRankFailed) naming the rank. A member that
// loses rank 0 fails the same way, naming rank 0. Abort fails the job
// naming the calling rank; a cancelled collective aborts too (the ranks
// could no longer agree on which collective comes next). A group tells its
// peers before its own callers learn of the failure, so a process exiting
// on the error has told them. Nothing waits without a bound.
//
// # Launch
//
// Launch starts the ranks of one node as torchrun --nproc-per-node does
// (see its doc): MASTER_ADDR=127.0.0.1 and a port it holds open, passed
// to rank 0 as an inherited socket; each rank's output prefixed with
// "[rank N] "; SIGINT and SIGTERM forwarded. When a rank fails the others
// get a grace period to end on their own (the control plane tells them),
// then SIGTERM, then SIGKILL, and Launch names the rank that caused the
// failure: each rank's failed group writes the rank it blames on its
// report pipe (DISTILL_RDZV_REPORT_FD), since the order in which exits are
// seen is not the order of the failures.
package dist
