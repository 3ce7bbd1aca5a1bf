package cache

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	badger "github.com/dgraph-io/badger/v4"
)

// Options tune how a cache is opened. The zero value is usable.
type Options struct {
	// FS carries chunk file I/O; nil means OSFS. Tests inject faults here.
	FS FS
	// LockTimeout bounds the wait for the directory lock; 0 means 60s.
	LockTimeout time.Duration
}

func (o *Options) withDefaults() Options {
	var r Options
	if o != nil {
		r = *o
	}
	if r.FS == nil {
		r.FS = OSFS
	}
	if r.LockTimeout == 0 {
		r.LockTimeout = 60 * time.Second
	}
	return r
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Cache is a cache directory opened for filling under one manifest. It is
// safe for concurrent use by several goroutines (one ChunkWriter each), and
// several processes may fill the same directory at once: index updates are
// serialized by the directory lock and a range is recorded at most once.
//
// The manifest of a cache is provisional until its first chunk is
// committed: a fill that failed before committing anything does not bind
// the directory, and the next Create (or Use) with another manifest
// replaces it. From the first committed chunk on, every writer's manifest
// must agree with it field by field; Commit checks this under the lock, so
// of two writers with different manifests racing on an empty cache, the
// first to commit wins and the other gets ErrManifestMismatch.
type Cache struct {
	dir  string
	opts Options
	m    Manifest
	ws   *writerState // shared by the handles Use derives
	root bool         // Close releases ws only from the root handle
}

// writerState is one writer instance's temporary directory and commit
// serialization, shared by the handles of one Create/Open.
type writerState struct {
	mu sync.Mutex
	// tmp is this instance's private directory under tmp/, locked by an
	// flock on tmp/<id>/owner.lock for the instance's lifetime so that GC in
	// any process can tell a live writer's files from a dead one's.
	tmp   string
	owner *os.File
	seq   atomic.Int64 // names temporary files
	// opened is what the GC run by Create/Open removed.
	opened GCReport
}

// Create opens dir for filling with manifest m, creating the cache if the
// directory holds none. If it holds a cache with committed chunks, m must
// agree with its manifest field by field (the error names the first field
// that differs); a cache with no committed chunk takes m. Create then runs
// GC to remove what a crashed writer left behind.
func Create(dir string, m Manifest, opts *Options) (*Cache, error) {
	m.normalize()
	if err := m.Validate(); err != nil {
		return nil, err
	}
	return open(dir, &m, opts)
}

// Open opens an existing cache for filling with the manifest it holds (see
// Create).
func Open(dir string, opts *Options) (*Cache, error) { return open(dir, nil, opts) }

func open(dir string, want *Manifest, opts *Options) (*Cache, error) {
	o := opts.withDefaults()
	if want == nil {
		if err := statIndex(dir); err != nil {
			return nil, err
		}
	}
	for _, d := range []string{dir, filepath.Join(dir, chunksDir), filepath.Join(dir, tmpDir)} {
		if err := o.FS.MkdirAll(d); err != nil {
			return nil, fmt.Errorf("cache: creating %s: %w", d, err)
		}
	}
	s, err := openIndex(dir, true, o.LockTimeout)
	if err != nil {
		return nil, err
	}
	c := &Cache{dir: dir, opts: o, ws: &writerState{}, root: true}
	if want == nil {
		var ok bool
		c.m, ok, err = s.manifest()
		if err == nil && !ok {
			err = fmt.Errorf("%w: %s: index has no manifest", ErrNotCache, dir)
		}
		if err == nil {
			if err = c.m.Validate(); err != nil {
				err = fmt.Errorf("%s: %w", dir, err)
			}
		}
	} else {
		c.m = *want
		err = adopt(s, dir, want)
	}
	if err == nil {
		// Made under the directory lock, which GC also holds: GC never sees
		// this directory before its owner lock is held.
		err = c.makeTmp()
	}
	if cerr := s.close(); err == nil {
		err = cerr
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	if c.ws.opened, err = c.GC(); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// adopt makes want the index's manifest, under the exclusive lock of s:
// it agrees with the manifest there, or no chunk is committed yet (then
// want replaces it). Otherwise the error names the first differing field.
func adopt(s *indexSession, dir string, want *Manifest) error {
	have, ok, err := s.manifest()
	if err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	}
	if ok && want.Agree(&have, "the requested manifest", dir) == nil {
		return nil
	}
	rs, err := s.ranges()
	if err != nil {
		return fmt.Errorf("%s: %w", dir, err)
	}
	if ok && len(rs) > 0 {
		if err := have.Validate(); err != nil {
			return fmt.Errorf("%s: %w", dir, err)
		}
		return bound(want.Agree(&have, "the requested manifest", dir), rs)
	}
	return s.db.Update(func(txn *badger.Txn) error { return txn.Set([]byte{keyManifest}, want.marshal()) })
}

// bound adds to a manifest mismatch what binds the directory to its
// manifest: its committed chunks. The mismatch named the directory last
// ("4 in DIR"), so this does not again.
func bound(err error, rs []ChunkInfo) error {
	var n int64
	for _, r := range rs {
		n += r.Len()
	}
	return fmt.Errorf("%w, whose %d committed chunks (%d samples) were made under it", err, len(rs), n)
}

// Use returns a handle that fills c's directory under manifest m: m must
// agree with the manifest in the index, or the index must hold no
// committed chunk, and then m replaces it (see Cache). A daemon serving
// fills of any dataset calls it per request, so a request that failed
// before committing anything leaves the directory free for the next one.
// The handle shares c's temporary directory: it is valid while c is open,
// and its Close does nothing. If m agrees with c's manifest, Use returns c.
func (c *Cache) Use(m Manifest) (*Cache, error) {
	m.normalize()
	if err := m.Validate(); err != nil {
		return nil, err
	}
	c.ws.mu.Lock()
	defer c.ws.mu.Unlock()
	s, err := openIndex(c.dir, true, c.opts.LockTimeout)
	if err != nil {
		return nil, err
	}
	err = adopt(s, c.dir, &m)
	if cerr := s.close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	if m.Agree(&c.m, "", "") == nil {
		return c, nil
	}
	return &Cache{dir: c.dir, opts: c.opts, m: m, ws: c.ws}, nil
}

func (c *Cache) makeTmp() error {
	var id [6]byte
	rand.Read(id[:])
	ws := c.ws
	ws.tmp = filepath.Join(c.dir, tmpDir, fmt.Sprintf("%d-%s", os.Getpid(), hex.EncodeToString(id[:])))
	if err := c.opts.FS.MkdirAll(ws.tmp); err != nil {
		return fmt.Errorf("cache: creating %s: %w", ws.tmp, err)
	}
	f, err := os.OpenFile(filepath.Join(ws.tmp, ownerLock), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("cache: creating %s: %w", ws.tmp, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return fmt.Errorf("cache: locking %s: %w", ws.tmp, err)
	}
	ws.owner = f
	return nil
}

// OpenGC returns what the GC run by Create or Open removed: the debris of
// writers that died.
func (c *Cache) OpenGC() GCReport { return c.ws.opened }

// Manifest returns the manifest this handle fills under.
func (c *Cache) Manifest() Manifest { return c.m }

// Dir returns the cache directory.
func (c *Cache) Dir() string { return c.dir }

// Close releases the instance's temporary directory. On a handle from Use
// it does nothing.
func (c *Cache) Close() error {
	if !c.root {
		return nil
	}
	ws := c.ws
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.owner == nil {
		return nil
	}
	err := c.opts.FS.RemoveAll(ws.tmp)
	ws.owner.Close()
	ws.owner = nil
	return err
}

// Current returns the manifest recorded in the index and the committed
// chunks sorted by start, as of now. The manifest may differ from this
// handle's while no chunk is committed (see Cache), or once another
// writer's first commit bound the directory to its own.
func (c *Cache) Current() (Manifest, []ChunkInfo, error) {
	s, err := openIndex(c.dir, false, c.opts.LockTimeout)
	if err != nil {
		return Manifest{}, nil, err
	}
	m, _, err := s.manifest()
	var rs []ChunkInfo
	if err == nil {
		rs, err = s.ranges()
	}
	if cerr := s.close(); err == nil {
		err = cerr
	}
	return m, rs, err
}

// Chunks returns the committed chunks sorted by start, as of now.
func (c *Cache) Chunks() ([]ChunkInfo, error) {
	s, err := openIndex(c.dir, false, c.opts.LockTimeout)
	if err != nil {
		return nil, err
	}
	rs, err := s.ranges()
	if cerr := s.close(); err == nil {
		err = cerr
	}
	return rs, err
}

// Missing returns the parts of [start, end) not covered by committed
// chunks, in order. Ranges in flight in another process count as missing.
func (c *Cache) Missing(start, end int64) ([]Range, error) {
	rs, err := c.Chunks()
	if err != nil {
		return nil, err
	}
	return MissingOf(rs, Range{start, end}), nil
}

// MissingOf returns the parts of want that none of chunks covers: sorted,
// disjoint, non-empty ranges inside want, nil when chunks cover it all.
// chunks must be sorted by Start, as Cache.Chunks and Reader.Chunks return
// them; they may overlap one another and reach beyond want. MissingOf
// reads no index: the gaps are those of the chunks the caller read, so a
// caller that reports what is done and plans what is left from one read
// sees every chunk in exactly one of the two (Cache.Missing reads the
// index itself).
func MissingOf[C ranged](chunks []C, want Range) []Range {
	var out []Range
	at := want.Start
	for _, ch := range chunks {
		r := ch.span()
		if r.End <= at || r.Start >= want.End {
			continue
		}
		if r.Start > at {
			out = append(out, Range{at, r.Start})
		}
		at = max(at, r.End)
	}
	if at < want.End {
		out = append(out, Range{at, want.End})
	}
	return out
}

// ranged is what MissingOf takes chunks as: Ranges, or the records that
// embed one (ChunkInfo, ReaderChunk), so that no caller copies the ranges
// out of its records first.
type ranged interface{ span() Range }

// span returns r itself; ChunkInfo and ReaderChunk have it through their
// embedded Range.
func (r Range) span() Range { return r }

func (c *Cache) checkRange(r Range) error {
	if r.Start < 0 || r.End > c.m.Samples || r.Start >= r.End {
		return fmt.Errorf("%w: range %v: want 0 <= start < end <= samples (%d)", ErrInvalid, r, c.m.Samples)
	}
	if r.Len() > MaxChunkSamples {
		return fmt.Errorf("%w: range %v has %d samples; a chunk holds at most %d (split the range)", ErrInvalid, r, r.Len(), MaxChunkSamples)
	}
	return nil
}

// conflict returns ErrRangeDone if r is committed exactly, an
// *OverlapError (ErrInvalid) if r partly overlaps a committed chunk, nil
// otherwise.
func conflict(rs []ChunkInfo, r Range) error {
	i := findOverlap(rs, r)
	if i < 0 {
		return nil
	}
	if rs[i].Range == r {
		return fmt.Errorf("%w: %v", ErrRangeDone, r)
	}
	return &OverlapError{Want: r, Chunk: rs[i]}
}

// OverlapError is BeginChunk's ErrInvalid for a range that partly
// overlaps a committed chunk. A fill that planned its ranges from
// Missing meets it only when another writer committed a chunk of other
// bounds since: it plans the range again (Missing) and fills the parts.
type OverlapError struct {
	Want  Range
	Chunk ChunkInfo
}

func (e *OverlapError) Error() string {
	return fmt.Sprintf("%v: range %v overlaps committed chunk %v (%s); fill ranges must follow the committed chunk boundaries", ErrInvalid, e.Want, e.Chunk.Range, e.Chunk.File)
}

func (e *OverlapError) Unwrap() error { return ErrInvalid }

// MaxChunkEntries bounds the (position, k) entries of one chunk: its
// per-entry list columns (id_code*, lp_*) have int32 Arrow offsets, so a
// chunk past 2^31-1 entries could be written but not read back. A variable
// so that tests can lower it.
var MaxChunkEntries int64 = math.MaxInt32

// checkEntries refuses a chunk that would reach positions*k entries over
// MaxChunkEntries, naming the sample that crosses the limit and the fix.
func checkEntries(r Range, sample, positions int64, k int) error {
	if n := positions * int64(k); n > MaxChunkEntries {
		return fmt.Errorf("%w: chunk %v: sample %d brings it to %d positions x k %d = %d top-k entries, over the %d one Arrow chunk file can index (int32 list offsets); fill with fewer samples per chunk (cachectl fill --chunk, FillRequest.chunk_samples)", ErrInvalid, r, sample, positions, k, n, MaxChunkEntries)
	}
	return nil
}

// ChunkWriter collects the samples of one range [start, end) and commits
// them as one chunk. Samples must be added in index order.
type ChunkWriter struct {
	c       *Cache
	r       Range
	samples []Sample
	tokens  int64
	done    bool
	release func() // the range's claim
}

// BeginChunk starts a chunk for [start, end) and claims the range until
// Commit or Abort (see Claim). It returns an error wrapping ErrRangeDone
// if that exact range is already committed (the caller skips it),
// ErrRangeBusy (a *BusyError) if a live writer claims a range
// overlapping it (the caller does other work and tries again later), and
// ErrInvalid if it partly overlaps a committed chunk. A ChunkWriter must
// end in Commit or Abort, or its claim lasts as long as the Cache.
func (c *Cache) BeginChunk(start, end int64) (_ *ChunkWriter, err error) {
	r := Range{start, end}
	if err := c.checkRange(r); err != nil {
		return nil, err
	}
	// The claim first, then the committed ranges: a writer commits only
	// under its claim, so a range committed before ours was taken is seen.
	release, err := c.claim(r)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			release()
		}
	}()
	have, rs, err := c.Current()
	if err != nil {
		return nil, err
	}
	if err := conflict(rs, r); err != nil {
		return nil, err
	}
	if len(rs) > 0 {
		if err := c.m.Agree(&have, "this writer's manifest", c.dir); err != nil {
			return nil, bound(err, rs)
		}
	}
	return &ChunkWriter{c: c, r: r, samples: make([]Sample, 0, r.Len()), release: release}, nil
}

// Range returns the writer's range.
func (w *ChunkWriter) Range() Range { return w.r }

// Add validates s and appends a copy of it; s.Index must be the next index
// of the range.
func (w *ChunkWriter) Add(s Sample) error {
	if w.done {
		return fmt.Errorf("%w: chunk %v: Add after Commit or Abort", ErrInvalid, w.r)
	}
	next := w.r.Start + int64(len(w.samples))
	if s.Index != next {
		return fmt.Errorf("%w: chunk %v: got sample %d, want %d (add samples in index order)", ErrInvalid, w.r, s.Index, next)
	}
	if err := validateSample(&w.c.m, &s); err != nil {
		return err
	}
	if err := checkEntries(w.r, s.Index, w.tokens+int64(len(s.Tokens)), w.c.m.entryWidth()); err != nil {
		return err
	}
	w.tokens += int64(len(s.Tokens))
	w.samples = append(w.samples, Sample{
		Index:        s.Index,
		Tokens:       append([]int32(nil), s.Tokens...),
		Mask:         append([]uint8(nil), s.Mask...),
		TopKIDs:      append([]int32(nil), s.TopKIDs...),
		TopKLogProbs: append([]float32(nil), s.TopKLogProbs...),
		DrawN:        append([]int32(nil), s.DrawN...),
		DrawIDs:      append([]int32(nil), s.DrawIDs...),
		DrawCounts:   append([]int32(nil), s.DrawCounts...),
		TailMass:     append([]float32(nil), s.TailMass...),
	})
	return nil
}

// Abort drops the chunk; nothing of it reaches the cache.
func (w *ChunkWriter) Abort() {
	w.done, w.samples = true, nil
	w.release()
}

// Commit makes the range visible: it encodes the chunk, writes it to a
// temporary file, syncs it, and then, under the exclusive directory lock,
// renames it into chunks/, syncs the directory and records the chunk and
// its samples in one index transaction. If another writer committed the
// same range meanwhile, Commit drops this copy and returns nil: each range
// is recorded exactly once. On error nothing becomes visible.
func (w *ChunkWriter) Commit() error {
	if w.done {
		return fmt.Errorf("%w: chunk %v: Commit after Commit or Abort", ErrInvalid, w.r)
	}
	w.done = true
	defer w.release() // after publish: a commit happens under its claim
	if int64(len(w.samples)) != w.r.Len() {
		return fmt.Errorf("%w: chunk %v: %d samples added, want %d", ErrInvalid, w.r, len(w.samples), w.r.Len())
	}
	c, fs := w.c, w.c.opts.FS
	data, err := encodeChunk(&c.m, w.r, w.samples)
	w.samples = nil
	if err != nil {
		return err
	}
	info := ChunkInfo{Range: w.r, File: chunkFileName(w.r), Bytes: int64(len(data)), CRC32C: crc32.Checksum(data, castagnoli)}
	// Unique per commit: goroutines of one Cache may race for one range.
	tmp := filepath.Join(c.ws.tmp, fmt.Sprintf("%s.%d%s", info.File, c.ws.seq.Add(1), tmpFileExt))
	if err := writeFileSync(fs, tmp, data); err != nil {
		fs.Remove(tmp)
		return fmt.Errorf("cache: writing chunk %v to %s: %w", w.r, tmp, err)
	}
	data = nil
	info.Tokens = w.tokens
	c.ws.mu.Lock()
	defer c.ws.mu.Unlock()
	s, err := openIndex(c.dir, true, c.opts.LockTimeout)
	if err != nil {
		fs.Remove(tmp)
		return err
	}
	err = w.publish(s, tmp, info)
	if cerr := s.close(); err == nil {
		err = cerr
	}
	if err != nil {
		fs.Remove(tmp)
	}
	return err
}

func (w *ChunkWriter) publish(s *indexSession, tmp string, info ChunkInfo) error {
	c, fs := w.c, w.c.opts.FS
	rs, err := s.ranges()
	if err != nil {
		return err
	}
	if err := conflict(rs, w.r); err != nil {
		if errors.Is(err, ErrRangeDone) {
			return fs.Remove(tmp) // someone else committed it first: a no-op
		}
		return err
	}
	// The first committed chunk fixes the manifest: until then another
	// writer may have replaced it (see Cache), and this commit puts ours
	// back in the same transaction as the chunk record.
	have, ok, err := s.manifest()
	if err != nil {
		return err
	}
	setManifest := !ok || c.m.Agree(&have, "", "") != nil
	if !ok && len(rs) > 0 {
		return fmt.Errorf("%w: %s: the index holds %d chunk records but no manifest", ErrCorrupt, c.dir, len(rs))
	}
	if setManifest && len(rs) > 0 {
		return bound(c.m.Agree(&have, "this writer's manifest", c.dir), rs)
	}
	final := filepath.Join(c.dir, chunksDir, info.File)
	if err := fs.Rename(tmp, final); err != nil {
		return fmt.Errorf("cache: publishing chunk %v: %w", w.r, err)
	}
	unpublish := func(err error) error {
		fs.Remove(final) // unreferenced either way; GC would remove it too
		return err
	}
	if err := fs.SyncDir(filepath.Join(c.dir, chunksDir)); err != nil {
		return unpublish(fmt.Errorf("cache: syncing %s after publishing chunk %v: %w", chunksDir, w.r, err))
	}
	rec, _ := json.Marshal(info)
	err = s.db.Update(func(txn *badger.Txn) error {
		for i := w.r.Start; i < w.r.End; i++ {
			if err := txn.Set(sampleKey(i), sampleValue(w.r.Start, uint32(i-w.r.Start))); err != nil {
				return err
			}
		}
		if setManifest {
			if err := txn.Set([]byte{keyManifest}, c.m.marshal()); err != nil {
				return err
			}
		}
		return txn.Set(rangeKey(w.r.Start), rec)
	})
	if err != nil {
		return unpublish(fmt.Errorf("cache: recording chunk %v in the index: %w", w.r, err))
	}
	return nil
}

func writeFileSync(fs FS, name string, data []byte) error {
	f, err := fs.Create(name)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// GCReport lists what GC removed.
type GCReport struct {
	// Files are the removed paths, relative to the cache directory.
	Files []string
}

// GC removes chunk files no index record references (left by a writer that
// died between rename and index update) and the temporary directories of
// writers that no longer run. It holds the exclusive lock, so it never
// races with a commit.
func (c *Cache) GC() (GCReport, error) {
	c.ws.mu.Lock()
	defer c.ws.mu.Unlock()
	s, err := openIndex(c.dir, true, c.opts.LockTimeout)
	if err != nil {
		return GCReport{}, err
	}
	defer s.close()
	return gc(s, c.dir, c.opts.FS, c.ws.tmp)
}

// gc is GC under the exclusive lock held by s; self is the caller's own
// temporary directory (kept), if any.
func gc(s *indexSession, dir string, fs FS, self string) (GCReport, error) {
	var rep GCReport
	rs, err := s.ranges()
	if err != nil {
		return rep, err
	}
	ref := make(map[string]bool, len(rs))
	for _, r := range rs {
		ref[r.File] = true
	}
	names, err := fs.ReadDir(filepath.Join(dir, chunksDir))
	if err != nil {
		return rep, fmt.Errorf("cache: gc: %w", err)
	}
	for _, n := range names {
		if ref[n] {
			continue
		}
		p := filepath.Join(chunksDir, n)
		if err := fs.Remove(filepath.Join(dir, p)); err != nil {
			return rep, fmt.Errorf("cache: gc: %w", err)
		}
		rep.Files = append(rep.Files, p)
	}
	names, err = fs.ReadDir(filepath.Join(dir, tmpDir))
	if err != nil {
		return rep, fmt.Errorf("cache: gc: %w", err)
	}
	for _, n := range names {
		p := filepath.Join(dir, tmpDir, n)
		if p == self || !ownerDead(p) {
			continue
		}
		if err := fs.RemoveAll(p); err != nil {
			return rep, fmt.Errorf("cache: gc: %w", err)
		}
		rep.Files = append(rep.Files, filepath.Join(tmpDir, n))
	}
	return rep, nil
}

// ownerDead reports whether the writer owning tmp dir p is gone: its
// owner.lock is not flocked (the kernel drops the lock when a process
// dies), or p is not a writer directory at all.
func ownerDead(p string) bool {
	if strings.HasSuffix(p, tmpFileExt) {
		return true
	}
	f, err := os.Open(filepath.Join(p, ownerLock))
	if err != nil {
		return true
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		return false
	}
	return true
}
