// Package cache is the on-disk cache of teacher top-k distributions used
// for offline knowledge distillation, and this comment is its format spec.
//
// # What is stored
//
// A dataset has Manifest.Samples samples, indexed [0, Samples). Sample i
// has T tokens; for every position t in [0, T) the cache holds the
// teacher's top-K next-token distribution after reading tokens[0..t] (the
// prediction of token t+1): K token ids sorted by descending probability
// and their log-probs normalized over the full vocabulary, so the tail mass
// 1 - sum_K exp(lp) is known. It also holds the tokens and the loss mask
// (mask[t] = 1: token t is a training target). T may be 0: an empty row
// stands for a dataset record that the data layer dropped (over max_len
// with policy drop) or skipped (--skip-bad), so that cache indexes stay the
// dataset's; readers return it with no tokens and trainers skip it.
//
// The manifest's targets field says which of three kinds of teacher
// targets every position holds (cachectl fill --targets):
//
//   - topk (no targets field; format version 1): the top-K above.
//   - sampled (format version 2, k 0): N draws with replacement from the
//     teacher's full distribution at the capture temperature (N is the
//     manifest's draws), stored as the distinct ids drawn and their
//     counts. count/N is an unbiased estimate of p: E[count_v/N] = p_v
//     for every id, in the tail too (Anshumann et al. 2025, "Sparse Logit
//     Sampling"), where a top-k cache is biased.
//   - head+sampled (format version 2, k >= 1): the exact top-K (the head)
//     as in a topk cache, plus N draws from the distribution outside the
//     head renormalized, as ids and counts, and the head's complement
//     tail_mass = Σ_{v∉head} p_v. The target p_v on the head and
//     tail_mass·count_v/N on the drawn ids is unbiased with a lower variance
//     than pure sampling: the head is exact and the draws only estimate
//     how the tail mass is split.
//
// # Draws
//
// Draw d (0 <= d < N) of position t of sample i takes the uniform
//
//	key = little-endian uint64 of SHA-256("distill.draws\x00" + dataset_fingerprint)[0:8]
//	sm(x) = SplitMix64's output on x + 0x9e3779b97f4a7c15
//	u = (sm(sm(sm(key ^ i) ^ t) ^ d) >> 11) / 2^53        in [0, 1)
//
// (DrawUniform) and inverts the CDF in ascending id order: the draw is the
// smallest id v (outside the head under head+sampled) whose cumulative
// probability Σ_{w<=v} p_w exceeds u times the mass drawn from (1, or the
// tail mass); a u so close to 1 that rounding leaves it above the sum
// draws the last id with mass. The generator is counter based: a range
// refilled by another process or node draws the same ids wherever the
// teacher's probabilities agree. A position's draws are stored as its
// distinct ids by descending count (ties: ascending id); a head+sampled
// position whose tail mass is exactly 0 has no draws.
//
// The teacher computes this in its streaming LM head, in the one pass over
// the vocabulary that makes the top-k (compute.Backend's LMHeadSample):
// the softmax's sums over blocks of 64 ids, then each threshold located
// among the blocks' cumulative sums and only its block's logits computed
// again and walked in float64. The CDF is the fp32 logits' to about 1e-6
// relative (the backend's exp and logits), so ids agree with a float64
// inverse CDF, and between backends and teachers, except where a threshold
// lies that close to a step of the CDF; an id more than 87 nats below the
// largest logit of its vocabulary tile (2048 ids or more) counts as mass 0,
// unless its block holds a head id. This is the definition above computed
// to that accuracy, not a new one: caches filled before it (format version
// 2, whose teacher summed the CDF over the whole vocabulary on the host)
// stay valid and agree with new fills to the same accuracy.
//
// # Directory layout
//
//	DIR/
//	  LOCK                       flock: exclusive while the index is written,
//	                             shared while it is read (see below)
//	  index/                     Badger v4 database (keys below)
//	    LOCK                     Badger's own flock on index/ (not ours)
//	  chunks/AAAAAAAAAAAA-BBBBBBBBBBBB.arrow
//	                             immutable Arrow IPC file of samples [A, B),
//	                             A and B zero-padded to 12 digits
//	  tmp/<pid>-<hex>/           a live writer's private directory:
//	    owner.lock               flocked by that writer while it lives
//	    claim-AAAAAAAAAAAA-BBBBBBBBBBBB
//	                             its claim on the range it computes (JSON:
//	                             pid, host, since); see Claim
//	    <chunk name>.<n>.tmp     a chunk being written
//	  tmp/reset-<hex>.tmp/       an index being deleted by Reset
//
// Nothing else in DIR matters; a cache directory can be copied with cp -r
// or rsync when no writer runs.
//
// # Index key layout (Badger)
//
//	"m"                 -> manifest, JSON (Manifest)
//	"r" + be64(A)       -> chunk record, JSON (ChunkInfo): start A, end B,
//	                       file name, byte size, CRC-32C (Castagnoli) of the
//	                       whole file, token count
//	"s" + be64(i)       -> be64(A) + be32(i - A): sample i lives in the
//	                       chunk starting at A, row i - A
//
// A range is "done" exactly when its "r" record exists; the per-chunk
// checksums of the manifest are the CRC-32C fields of the "r" records.
//
// The "m" record is provisional until the first "r" record exists: Create
// (and Cache.Use, which teacherd calls per Fill request) replaces the
// manifest of a cache with no committed chunk, so a fill that failed
// before its first commit does not bind the directory to its dataset,
// teacher, k, temperature or encoding. Commit re-reads "m" under the
// exclusive lock and, while no chunk is committed, writes its own
// manifest in the same transaction as its "r" record; once a chunk is
// committed every writer must agree with "m" field by field
// (ErrManifestMismatch, naming the field and the committed chunks).
//
// # Chunk files
//
// One Arrow IPC file (format version 1 of this package for topk, 2 for the
// sampled kinds; Arrow IPC file format, buffers zstd-compressed where that saves at least 5%) with one
// record batch, one row per sample in index order, and schema metadata
// distill.format_version, distill.encoding, distill.k, distill.vocab_size,
// distill.range_start, distill.range_end (and, format version 2,
// distill.targets and distill.draws). All columns are plain Arrow types
// that any Arrow IPC reader with zstd support opens (pyarrow.ipc.open_file;
// TestChunkReadableByArrowJS reads chunks with Apache Arrow's JavaScript
// implementation and applies the formulas below written in JavaScript).
// With T the row's token count and K the manifest's k, the columns are:
//
//	index       int64         sample index
//	input_ids   list<int32>   (T) token ids
//	loss_mask   list<uint8>   (T) 0 or 1
//	id_dict     list<int32>   the chunk's id dictionary in row 0, empty in
//	                          the other rows: the distinct top-k ids of the
//	                          chunk by descending frequency
//	id_code0..2 list<uint8>   (T*K) byte planes of the dictionary code
//
//	topk_ids[t,j] = id_dict[0][id_code0[t*K+j] + 256*id_code1[t*K+j] + 65536*id_code2[t*K+j]]
//
// The sampled kinds (format version 2) add, after the columns above (a
// sampled chunk, k 0, has neither the id codes nor the log-probs):
//
//	draw_n        list<uint16>  (T) distinct ids drawn at each position
//	draw_code0..2 list<uint8>   (D) byte planes of their dictionary codes
//	draw_count0,1 list<uint8>   (D) byte planes of their counts (>= 1)
//	tail_bits0..3 list<uint8>   (T) head+sampled only: float32 bits of the
//	                            tail mass
//
// with D = Σ_t draw_n[t]: position t's draws are the draw_n[t] entries
// after those of positions 0..t-1, ids from the same dictionary (which
// counts drawn ids too), count = c0 + 256*c1, the counts of a position
// summing to N. In Python, for row r of a sampled or head+sampled chunk:
//
//	t = pyarrow.ipc.open_file(path).read_all()
//	col = lambda name: np.asarray(t[name][r].values).astype(np.int64)
//	dict_ = np.asarray(t["id_dict"][0].values)
//	n = col("draw_n"); off = np.concatenate([[0], np.cumsum(n)])
//	ids = dict_[col("draw_code0") | col("draw_code1") << 8 | col("draw_code2") << 16]
//	counts = col("draw_count0") | col("draw_count1") << 8
//	N = int(t.schema.metadata[b"distill.draws"])
//	# position p: ids[off[p]:off[p+1]] with target counts[off[p]:off[p+1]] / N
//	tail = (col("tail_bits0") | col("tail_bits1") << 8 | col("tail_bits2") << 16
//	        | col("tail_bits3") << 24).astype(np.uint32).view(np.float32)  # head+sampled
//
// List offsets are int32 (plain Arrow lists, not large lists), so a chunk
// holds at most MaxChunkEntries = 2^31-1 (position, k) entries in all
// (k + N per position for the sampled kinds):
// ChunkWriter.Add refuses the sample that would cross it (ErrInvalid,
// naming the sample; fill that range with fewer samples per chunk) rather
// than write a file no reader can open.
//
// Byte planes and the frequency-ordered dictionary make zstd see small,
// skewed bytes; ids are always exact. The log-probs depend on the encoding.
//
// Lossless (Manifest.Encoding "lossless"):
//
//	lp_bits0..3 list<uint8>   (T*K) byte planes of the float32 bits
//	topk_logprobs[t,j] = float32frombits(b0 + b1<<8 + b2<<16 + b3<<24)
//
// Compact (Manifest.Encoding "compact"), an integer closed-loop delta code
// in units of 1/4096 nat:
//
//	lp_top      list<uint16>  (T)       -lp[t,0] * 4096, rounded
//	lp_delta0,1 list<uint8>   (T*(K-1)) byte planes of d[t,j], j = 1..K-1
//	acc[t,0] = lp_top[t]; acc[t,j] = acc[t,j-1] + 64 * d[t,j]
//	topk_logprobs[t,j] = -acc[t,j] / 4096   (computed in float32)
//
// The encoder picks d[t,j] from the reconstructed previous value, so
// errors do not accumulate: |error| <= 1/8192 nat for j = 0 and <= 1/128
// nat for j >= 1 (relative probability error <= 0.8%), down to log-probs
// of about -1000 (lower ones, -Inf included, saturate there). Decoded
// values stay sorted; their sum may exceed the true top-k mass by that
// relative error, so consumers clamp the tail mass at 0.
//
// In Python (numpy, pyarrow), for row r of a compact chunk:
//
//	t = pyarrow.ipc.open_file(path).read_all()
//	K = int(t.schema.metadata[b"distill.k"])
//	col = lambda name: np.asarray(t[name][r].values).astype(np.int64)
//	code = col("id_code0") | col("id_code1") << 8 | col("id_code2") << 16
//	ids = np.asarray(t["id_dict"][0].values)[code].reshape(-1, K)
//	top = col("lp_top")[:, None]
//	d = (col("lp_delta0") | col("lp_delta1") << 8).reshape(-1, K - 1)
//	acc = np.concatenate([top, top + 64 * np.cumsum(d, axis=1)], axis=1)
//	logprobs = -acc.astype(np.float32) / 4096
//
// Format constants (changing any needs a FormatVersion bump): the key
// layout and prefixes above, the column names and their order, the
// metadata keys, lpTopScale = 4096, lpDeltaUnit = 64, the draws' key,
// generator and CDF order, MaxDraws = 4096, the file naming,
// CRC-32C as checksum, MaxChunkSamples (16384, bounds an index
// transaction) and MaxChunkEntries (2^31-1, the int32 list offsets).
//
// # Sizes (BenchmarkEncodingSize, k = 64, V = 151936)
//
// On the synthetic teacher of package cachetest (Zipf ranks, peaked
// contexts, mean top-1 probability 0.58): compact 1.87 bytes per
// (position, k) entry including ids (120 B/token), KD loss (forward KL
// with a tail bucket, float64) from decoded values within 1e-4 relative of
// the exact one; lossless 3.98 bytes per entry (255 B/token). The figures
// are the same with randomly permuted ids thanks to the dictionary. For
// scale: Megatron-LM's offline KD stores ~528 B/token before zstd at
// k = 128, DistillKit quotes ~300 B/token at k = 128.
//
// # Writing and crash safety
//
// A writer (Create/Open, one Cache per process, any number of processes)
// fills ranges: BeginChunk(A, B), Add each sample in order, Commit.
// BeginChunk first claims the range (a claim file in the writer's tmp
// directory, made under the exclusive lock after checking every live
// writer's claims); a range that overlaps a live claim is ErrRangeBusy,
// so concurrent fills split the work instead of computing it twice, and
// the claim ends with Commit, Abort or the writer's death (Claim). Commit
// encodes the chunk, writes it to tmp/<writer>/, fsyncs and closes it;
// then, holding LOCK exclusively, re-reads the chunk records, renames the
// file into chunks/, fsyncs chunks/, and writes the "r" record and the "s"
// keys in one Badger transaction with SyncWrites. A range is therefore
// visible only after its file is complete, synced and in place, and a
// crash at any instant leaves either nothing or the whole range. A range
// committed meanwhile by another writer makes Commit a no-op (the copy is
// dropped), and BeginChunk of a done range returns ErrRangeDone, so
// re-filling is a no-op and each range is recorded exactly once. A range
// in flight when its process dies is simply missing (Cache.Missing) and is
// redone from scratch. GC (run by Create/Open and `cachectl gc`) removes
// chunk files no record references (a crash between rename and index
// write) and the tmp directories whose owner.lock is not held (dead
// writers); it runs under the exclusive lock, so it never races a commit.
//
// # Repair and reset
//
// Repair (cachectl repair) makes the index agree with the chunk files: it
// verifies every chunk as Check does, without a lock (chunk files are
// immutable), then under the exclusive lock deletes, in one transaction
// per chunk, the "r" record and the "s" keys of each chunk whose file is
// missing or fails a check, rewrites missing or wrong "s" keys of good
// chunks, deletes "s" keys that point at no chunk, and runs GC (which
// removes the dropped chunks' files). The dropped ranges are missing
// then, so the same fill recomputes exactly them. A chunk that cannot be
// read for a reason other than corruption (permission, EIO) stops Repair
// before it changes anything.
//
// Reset (cachectl reset) moves index/ into tmp/ (one rename: the directory
// stops being a cache), then deletes it, every chunk file and the
// temporary directories of dead writers, under the exclusive lock. It
// refuses a cache with committed chunks unless forced (ErrCommitted:
// committed data is never discarded by accident) and a cache that a live
// writer has open (ErrLocked). A crash in the middle leaves chunk files
// and no index: a directory whose index is lost (ErrIndexLost), as one
// whose index/ was deleted or not copied with its chunks/. Create, Open
// and the readers refuse it, naming the files, instead of taking it for a
// new cache (the GC of a new index would remove every chunk file); Reset
// with force removes them.
//
// # Permissions and read-only caches
//
// Reading needs only read permission on DIR, index/ and its files, and
// chunks/: a cache on a read-only mount, or owned by another user, opens
// for status, verify, inspect, export, train and eval. Readers open LOCK
// read-only and take the shared flock on that descriptor. If LOCK does not
// exist and cannot be created (EROFS, EACCES), no writer has opened this
// copy of the cache, and the reader reads without a lock; it does the same
// where the file system has no flock (ENOLCK, EOPNOTSUPP). Badger's
// read-only mode needs no write permission either: it flocks index/
// shared through a read-only descriptor and opens its files O_RDONLY.
// The one exception is recovery after a writer died inside an index
// session (below), which needs write permission once.
//
// Writers create directories 0755 and files 0644, less the umask. Badger
// makes index/ 0700 and MANIFEST and KEYREGISTRY 0600; after each index
// session the writer widens index/ and its files to the permission bits
// of DIR itself (adding bits only, so a cache in a 0700 directory stays
// private). Writing needs write permission on all of the cache.
//
// # Readers while a writer runs
//
// Badger lets one process open a directory read-write, and its read-only
// mode refuses a directory whose write-ahead log is live. So no process
// keeps the index open: a writer opens it for one commit (10-200 ms on a
// loaded machine, small next to the teacher time of a chunk), a reader
// opens it read-only under the shared lock just long enough to load the
// manifest and the chunk records (a few hundred bytes per chunk, so ~1 MB
// for 10M samples in 1000-sample chunks), then reads chunk files only.
// A Reader thus sees every range committed before it opened. If a writer
// died inside an index session, Badger's read-only open refuses the torn
// log; the reader then recovers the index with a read-write open (which
// also removes the empty log files a writer killed while Badger created
// them leaves, and which Badger would refuse), so it needs write
// permission once after such a crash.
//
// Index figures (BenchmarkIndexOpen, 10M samples in 1000-sample chunks,
// under load on 2 cores): 141 MB on disk, OpenReader 0.21 s keeping 1.1 MB
// of heap, a writer's open+close 0.12 s with 22 MB of heap.
//
// Badger's memory is capped by badgerOptions: 16 MiB memtables (2), 8 MiB
// block cache, 8 MiB index cache, 2 MiB tables; about 50 MiB per open
// index at most instead of the ~600 MiB of Badger's defaults.
//
// # Reading
//
// OpenReader(dirs...) opens one or more directories as one cache (their
// manifests must agree field by field; the error names the field). Get(i)
// is random access (it keeps the last two decoded chunks). Iter yields a
// seeded, sharded, block-shuffled order with read-ahead: the chunk order
// is shuffled, the samples of each window of IterOptions.Window chunks are
// shuffled together, and rank r of World takes the r-th of World equal
// contiguous slices of that sequence, so ranks read disjoint chunks.
// Every chunk read is checked against its size and CRC-32C and its
// structure against the record; any mismatch is ErrCorrupt naming the
// chunk file and its samples.
package cache
