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

// Cache is a cache directory opened for filling. It is safe for concurrent
// use by several goroutines (one ChunkWriter each), and several processes
// may fill the same directory at once: index updates are serialized by the
// directory lock and a range is recorded at most once.
type Cache struct {
	dir  string
	opts Options
	m    Manifest
	mu   sync.Mutex
	// tmp is this instance's private directory under tmp/, locked by an
	// flock on tmp/<id>/owner.lock for the instance's lifetime so that GC in
	// any process can tell a live writer's files from a dead one's.
	tmp   string
	owner *os.File
	seq   atomic.Int64 // names temporary files
	// opened is what the GC run by Create/Open removed.
	opened GCReport
}

// Create opens dir for filling, creating the cache with manifest m if the
// directory holds none. If it holds one, it must agree with m field by field
// (the error names the first field that differs). Create then runs GC to
// remove what a crashed writer left behind.
func Create(dir string, m Manifest, opts *Options) (*Cache, error) {
	if m.FormatVersion == 0 {
		m.FormatVersion = FormatVersion
	}
	if err := m.Validate(); err != nil {
		return nil, err
	}
	return open(dir, &m, opts)
}

// Open opens an existing cache for filling (see Create).
func Open(dir string, opts *Options) (*Cache, error) { return open(dir, nil, opts) }

func open(dir string, want *Manifest, opts *Options) (*Cache, error) {
	o := opts.withDefaults()
	if want == nil {
		if _, err := os.Stat(filepath.Join(dir, indexDir)); err != nil {
			return nil, fmt.Errorf("%w: %s: %v", ErrNotCache, dir, err)
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
	have, ok, err := s.manifest()
	if err == nil && !ok && want == nil {
		err = fmt.Errorf("%w: %s: index has no manifest", ErrNotCache, dir)
	}
	if err == nil && ok {
		if err = have.Validate(); err != nil {
			err = fmt.Errorf("%s: %w", dir, err)
		}
	}
	if err == nil && ok && want != nil {
		err = want.Agree(&have, "the requested manifest", dir)
	}
	if err == nil && !ok {
		err = s.db.Update(func(txn *badger.Txn) error { return txn.Set([]byte{keyManifest}, want.marshal()) })
		have = *want
	}
	c := &Cache{dir: dir, opts: o, m: have}
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
	if c.opened, err = c.GC(); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func (c *Cache) makeTmp() error {
	var id [6]byte
	rand.Read(id[:])
	c.tmp = filepath.Join(c.dir, tmpDir, fmt.Sprintf("%d-%s", os.Getpid(), hex.EncodeToString(id[:])))
	if err := c.opts.FS.MkdirAll(c.tmp); err != nil {
		return fmt.Errorf("cache: creating %s: %w", c.tmp, err)
	}
	f, err := os.OpenFile(filepath.Join(c.tmp, ownerLock), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("cache: creating %s: %w", c.tmp, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return fmt.Errorf("cache: locking %s: %w", c.tmp, err)
	}
	c.owner = f
	return nil
}

// OpenGC returns what the GC run by Create or Open removed: the debris of
// writers that died.
func (c *Cache) OpenGC() GCReport { return c.opened }

// Manifest returns the cache's manifest.
func (c *Cache) Manifest() Manifest { return c.m }

// Dir returns the cache directory.
func (c *Cache) Dir() string { return c.dir }

// Close releases the instance's temporary directory.
func (c *Cache) Close() error {
	if c.owner == nil {
		return nil
	}
	err := c.opts.FS.RemoveAll(c.tmp)
	c.owner.Close()
	c.owner = nil
	return err
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
	return missing(rs, Range{start, end}), nil
}

func missing(rs []ChunkInfo, want Range) []Range {
	var out []Range
	at := want.Start
	for _, r := range rs {
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

func (c *Cache) checkRange(r Range) error {
	if r.Start < 0 || r.End > c.m.Samples || r.Start >= r.End {
		return fmt.Errorf("%w: range %v: want 0 <= start < end <= samples (%d)", ErrInvalid, r, c.m.Samples)
	}
	if r.Len() > MaxChunkSamples {
		return fmt.Errorf("%w: range %v has %d samples; a chunk holds at most %d (split the range)", ErrInvalid, r, r.Len(), MaxChunkSamples)
	}
	return nil
}

// conflict returns ErrRangeDone if r is committed exactly, an ErrInvalid
// error if r partly overlaps a committed chunk, nil otherwise.
func conflict(rs []ChunkInfo, r Range) error {
	i := findOverlap(rs, r)
	if i < 0 {
		return nil
	}
	if rs[i].Range == r {
		return fmt.Errorf("%w: %v", ErrRangeDone, r)
	}
	return fmt.Errorf("%w: range %v overlaps committed chunk %v (%s); fill ranges must follow the committed chunk boundaries", ErrInvalid, r, rs[i].Range, rs[i].File)
}

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
}

// BeginChunk starts a chunk for [start, end). It returns an error wrapping
// ErrRangeDone if that exact range is already committed (the caller skips
// it), and ErrInvalid if it partly overlaps a committed chunk.
func (c *Cache) BeginChunk(start, end int64) (*ChunkWriter, error) {
	r := Range{start, end}
	if err := c.checkRange(r); err != nil {
		return nil, err
	}
	rs, err := c.Chunks()
	if err != nil {
		return nil, err
	}
	if err := conflict(rs, r); err != nil {
		return nil, err
	}
	return &ChunkWriter{c: c, r: r, samples: make([]Sample, 0, r.Len())}, nil
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
	if err := checkEntries(w.r, s.Index, w.tokens+int64(len(s.Tokens)), w.c.m.K); err != nil {
		return err
	}
	w.tokens += int64(len(s.Tokens))
	w.samples = append(w.samples, Sample{
		Index:        s.Index,
		Tokens:       append([]int32(nil), s.Tokens...),
		Mask:         append([]uint8(nil), s.Mask...),
		TopKIDs:      append([]int32(nil), s.TopKIDs...),
		TopKLogProbs: append([]float32(nil), s.TopKLogProbs...),
	})
	return nil
}

// Abort drops the chunk; nothing of it reaches the cache.
func (w *ChunkWriter) Abort() { w.done, w.samples = true, nil }

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
	tmp := filepath.Join(c.tmp, fmt.Sprintf("%s.%d%s", info.File, c.seq.Add(1), tmpFileExt))
	if err := writeFileSync(fs, tmp, data); err != nil {
		fs.Remove(tmp)
		return fmt.Errorf("cache: writing chunk %v to %s: %w", w.r, tmp, err)
	}
	data = nil
	info.Tokens = w.tokens
	c.mu.Lock()
	defer c.mu.Unlock()
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
	var rep GCReport
	fs := c.opts.FS
	c.mu.Lock()
	defer c.mu.Unlock()
	s, err := openIndex(c.dir, true, c.opts.LockTimeout)
	if err != nil {
		return rep, err
	}
	defer s.close()
	rs, err := s.ranges()
	if err != nil {
		return rep, err
	}
	ref := make(map[string]bool, len(rs))
	for _, r := range rs {
		ref[r.File] = true
	}
	names, err := fs.ReadDir(filepath.Join(c.dir, chunksDir))
	if err != nil {
		return rep, fmt.Errorf("cache: gc: %w", err)
	}
	for _, n := range names {
		if ref[n] {
			continue
		}
		p := filepath.Join(chunksDir, n)
		if err := fs.Remove(filepath.Join(c.dir, p)); err != nil {
			return rep, fmt.Errorf("cache: gc: %w", err)
		}
		rep.Files = append(rep.Files, p)
	}
	names, err = fs.ReadDir(filepath.Join(c.dir, tmpDir))
	if err != nil {
		return rep, fmt.Errorf("cache: gc: %w", err)
	}
	for _, n := range names {
		p := filepath.Join(c.dir, tmpDir, n)
		if p == c.tmp || !ownerDead(p) {
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
