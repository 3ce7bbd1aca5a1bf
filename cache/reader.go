package cache

import (
	"errors"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"sync"
)

// Reader reads one cache made of one or more directories whose manifests
// agree. It sees the chunks committed when it was opened; it never holds
// the index open, so writers keep filling while it reads. A Reader is safe
// for concurrent use.
type Reader struct {
	m      Manifest
	fs     FS
	chunks []ReaderChunk

	mu        sync.Mutex
	lru       []*chunk // most recently used last; for Get
	getChunks int      // lru's capacity; 0: getCacheChunks
}

// ReaderChunk is a committed chunk and the directory holding it.
type ReaderChunk struct {
	ChunkInfo
	// Dir is the cache directory holding the chunk.
	Dir string
}

// Path returns the chunk file's path.
func (rc *ReaderChunk) Path() string { return filepath.Join(rc.Dir, chunksDir, rc.File) }

const getCacheChunks = 2 // decoded chunks Get keeps for locality, by default

// SetGetCache sets how many decoded chunks Get keeps (default 2): a
// caller reading samples in another cache's shuffled order (several
// teachers' caches over the same samples) needs as many as that order
// touches at a time, or every Get decodes a chunk again.
func (r *Reader) SetGetCache(chunks int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.getChunks = max(chunks, 1)
	for len(r.lru) > r.getChunks {
		r.lru = r.lru[1:]
	}
}

// OpenReader opens dirs as one cache. Every directory must hold a cache
// whose manifest agrees with the first one's (the error names the field and
// both directories); chunks from different directories must not overlap
// unless they cover the same range (the first directory's copy is used).
func OpenReader(dirs ...string) (*Reader, error) { return OpenReaderOptions(nil, dirs...) }

// OpenReaderOptions is OpenReader with options (FS, lock timeout).
func OpenReaderOptions(opts *Options, dirs ...string) (*Reader, error) {
	o := opts.withDefaults()
	if len(dirs) == 0 {
		return nil, fmt.Errorf("%w: no cache directory given", ErrInvalid)
	}
	r := &Reader{fs: o.FS}
	for di, dir := range dirs {
		m, rs, err := loadIndex(dir, o)
		if err != nil {
			return nil, err
		}
		if di == 0 {
			r.m = m
		} else if err := r.m.Agree(&m, dirs[0], dir); err != nil {
			// The field says what differs; say also what to do, since
			// the usual cause is a directory from another fill.
			return nil, fmt.Errorf("%w: directories read as one cache must hold fills of one teacher, dataset and settings; read them one at a time (several teachers over the same samples: a training config's data.caches)", err)
		}
		for _, ci := range rs {
			r.chunks = append(r.chunks, ReaderChunk{ChunkInfo: ci, Dir: dir})
		}
	}
	sort.SliceStable(r.chunks, func(a, b int) bool { return r.chunks[a].Start < r.chunks[b].Start })
	out := r.chunks[:0]
	for _, c := range r.chunks {
		if n := len(out); n > 0 && out[n-1].End > c.Start {
			if out[n-1].Range == c.Range {
				continue // the same range filled twice: either copy will do
			}
			return nil, fmt.Errorf("%w: chunk %s in %s overlaps chunk %s in %s; these directories were not filled with the same chunk boundaries", ErrInvalid, out[n-1].File, out[n-1].Dir, c.File, c.Dir)
		}
		out = append(out, c)
	}
	r.chunks = out
	return r, nil
}

// loadIndex reads a directory's manifest and chunk table under the shared
// lock.
func loadIndex(dir string, o Options) (Manifest, []ChunkInfo, error) {
	s, err := openIndex(dir, false, o.LockTimeout)
	if err != nil {
		return Manifest{}, nil, err
	}
	defer s.close()
	m, ok, err := s.manifest()
	if err != nil {
		return m, nil, fmt.Errorf("%s: %w", dir, err)
	}
	if !ok {
		return m, nil, fmt.Errorf("%w: %s: index has no manifest", ErrNotCache, dir)
	}
	if err := m.Validate(); err != nil {
		return m, nil, fmt.Errorf("%s: %w", dir, err)
	}
	rs, err := s.ranges()
	if err != nil {
		return m, nil, fmt.Errorf("%s: %w", dir, err)
	}
	return m, rs, nil
}

// Manifest returns the cache's manifest.
func (r *Reader) Manifest() Manifest { return r.m }

// Chunks returns the committed chunks sorted by start.
func (r *Reader) Chunks() []ReaderChunk { return r.chunks }

// Samples returns the number of committed samples.
func (r *Reader) Samples() int64 {
	var n int64
	for _, c := range r.chunks {
		n += c.Len()
	}
	return n
}

// Missing returns the sample ranges of [0, Manifest.Samples) not committed.
func (r *Reader) Missing() []Range {
	return MissingOf(r.chunks, Range{0, r.m.Samples})
}

func (r *Reader) find(i int64) int {
	k := sort.Search(len(r.chunks), func(k int) bool { return r.chunks[k].End > i })
	if k < len(r.chunks) && r.chunks[k].Start <= i {
		return k
	}
	return -1
}

// Has reports whether sample i is committed.
func (r *Reader) Has(i int64) bool { return r.find(i) >= 0 }

// Get returns sample i.
func (r *Reader) Get(i int64) (Sample, error) {
	var s Sample
	k := r.find(i)
	if k < 0 {
		if i < 0 || i >= r.m.Samples {
			// Not a gap to fill: no fill of this dataset has it.
			return s, fmt.Errorf("%w: sample %d is outside [0, %d): the cache's dataset has %d samples", ErrNotFound, i, r.m.Samples, r.m.Samples)
		}
		return s, fmt.Errorf("%w: sample %d is not filled yet (committed: %d of %d samples; cachectl status lists the missing ranges)", ErrNotFound, i, r.Samples(), r.m.Samples)
	}
	c, err := r.getChunk(k)
	if err != nil {
		return s, err
	}
	err = c.sample(int(i-r.chunks[k].Start), &s)
	return s, err
}

func (r *Reader) getChunk(k int) (*chunk, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for j, c := range r.lru {
		if c.r == r.chunks[k].Range {
			r.lru = append(append(r.lru[:j:j], r.lru[j+1:]...), c)
			return c, nil
		}
	}
	c, err := r.loadChunk(k)
	if err != nil {
		return nil, err
	}
	n := r.getChunks
	if n == 0 {
		n = getCacheChunks
	}
	if len(r.lru) >= n {
		r.lru = r.lru[1:]
	}
	r.lru = append(r.lru, c)
	return c, nil
}

// loadChunk reads chunk k, checks its size and checksum against the index,
// and decodes it.
func (r *Reader) loadChunk(k int) (*chunk, error) {
	rc := &r.chunks[k]
	return loadChunkFile(r.fs, rc.Path(), &r.m, rc.ChunkInfo)
}

func loadChunkFile(fs FS, path string, m *Manifest, info ChunkInfo) (*chunk, error) {
	data, err := fs.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: chunk file %s of samples %v is missing (restore it, or run cachectl repair and fill again to recompute the range)", ErrCorrupt, path, info.Range)
	}
	if err != nil {
		return nil, fmt.Errorf("cache: reading chunk %s: %w", path, err)
	}
	if int64(len(data)) != info.Bytes {
		return nil, fmt.Errorf("%w: chunk file %s of samples %v has %d bytes, the index says %d (truncated or replaced)", ErrCorrupt, path, info.Range, len(data), info.Bytes)
	}
	if sum := crc32.Checksum(data, castagnoli); sum != info.CRC32C {
		return nil, fmt.Errorf("%w: chunk file %s of samples %v: checksum %08x, the index says %08x (the file was modified or damaged)", ErrCorrupt, path, info.Range, sum, info.CRC32C)
	}
	c, err := decodeChunk(data, m, info)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return c, nil
}

// IterOptions configure Reader.Iter.
type IterOptions struct {
	// Seed selects the order; use a different seed per epoch.
	Seed uint64
	// Rank and World shard the order: rank r of World gets the r-th of
	// World equal contiguous slices of it. World 0 means 1.
	Rank, World int
	// Window is how many chunks are shuffled together (default 4): the
	// chunk order is shuffled, then the samples of each run of Window
	// consecutive chunks are shuffled among themselves. Larger mixes
	// better and holds more decoded chunks in memory.
	Window int
	// ReadAhead is how many chunks are read and decoded ahead (default 2).
	ReadAhead int
	// Sequential iterates in index order (no shuffle); for export.
	Sequential bool
}

// Iterator yields samples; see Reader.Iter.
type Iterator struct {
	out  chan Sample
	done chan struct{}
	once sync.Once
	wg   sync.WaitGroup
	err  error
	cur  Sample
	n    int64
}

type window struct {
	chunks []int   // reader chunk indices
	off    []int64 // cumulative sample offsets, len(chunks)+1
	perm   []int32 // nil: sequential
	lo, hi int64   // the part of the window this rank takes
}

// Iter returns an iterator over the committed samples in a seeded order,
// sharded by rank. Every rank gets the same number of samples,
// floor(committed/World); the remainder (< World samples) is dropped.
// The order of a (Seed, World) pair is the same on every run and rank.
//
// The order is built from the chunks this Reader saw when it opened. Ranks
// partition it exactly (each sample to one rank per epoch) only if every
// rank's Reader saw the same chunks: open them after the fill has finished,
// not while chunks are still being committed.
func (r *Reader) Iter(o IterOptions) (*Iterator, error) {
	if o.World == 0 {
		o.World = 1
	}
	if o.World < 0 || o.Rank < 0 || o.Rank >= o.World {
		return nil, fmt.Errorf("%w: rank %d of world %d", ErrInvalid, o.Rank, o.World)
	}
	if o.Window <= 0 {
		o.Window = 4
	}
	if o.ReadAhead <= 0 {
		o.ReadAhead = 2
	}
	order := make([]int, len(r.chunks))
	for i := range order {
		order[i] = i
	}
	if o.Sequential {
		o.Window = 1
	} else {
		rand.New(rand.NewPCG(o.Seed, 0)).Shuffle(len(order), func(a, b int) { order[a], order[b] = order[b], order[a] })
	}
	per := r.Samples() / int64(o.World)
	lo, hi := int64(o.Rank)*per, int64(o.Rank+1)*per
	var plan []window
	var at int64
	for w := 0; w*o.Window < len(order); w++ {
		win := window{chunks: order[w*o.Window : min((w+1)*o.Window, len(order))]}
		win.off = make([]int64, len(win.chunks)+1)
		for i, k := range win.chunks {
			win.off[i+1] = win.off[i] + r.chunks[k].Len()
		}
		size := win.off[len(win.chunks)]
		if at+size > lo && at < hi {
			win.lo, win.hi = max(lo-at, 0), min(hi-at, size)
			if !o.Sequential {
				win.perm = make([]int32, size)
				for i := range win.perm {
					win.perm[i] = int32(i)
				}
				rng := rand.New(rand.NewPCG(o.Seed, uint64(w)+1))
				rng.Shuffle(len(win.perm), func(a, b int) { win.perm[a], win.perm[b] = win.perm[b], win.perm[a] })
			}
			plan = append(plan, win)
		}
		at += size
	}
	it := &Iterator{out: make(chan Sample, 64), done: make(chan struct{})}
	type loaded struct {
		k   int
		c   *chunk
		err error
	}
	need := func(win *window) []int { // window-local chunk slots this rank touches
		var out []int
		touched := make([]bool, len(win.chunks))
		for p := win.lo; p < win.hi; p++ {
			e := p
			if win.perm != nil {
				e = int64(win.perm[p])
			}
			touched[sort.Search(len(win.chunks), func(i int) bool { return win.off[i+1] > e })] = true
		}
		for i, t := range touched {
			if t {
				out = append(out, i)
			}
		}
		return out
	}
	loads := make(chan loaded, o.ReadAhead)
	needs := make([][]int, len(plan))
	for i := range plan {
		needs[i] = need(&plan[i])
	}
	it.wg.Add(2)
	go func() { // loader: reads, checks and parses chunks ahead of use
		defer it.wg.Done()
		defer close(loads)
		for i := range plan {
			for _, slot := range needs[i] {
				k := plan[i].chunks[slot]
				c, err := r.loadChunk(k)
				select {
				case loads <- loaded{k, c, err}:
				case <-it.done:
					return
				}
				if err != nil {
					return
				}
			}
		}
	}()
	go func() { // assembler: decodes samples in window order
		defer it.wg.Done()
		defer close(it.out)
		for i := range plan {
			win := &plan[i]
			got := make([]*chunk, len(win.chunks))
			for _, slot := range needs[i] {
				l, ok := <-loads
				if !ok {
					return
				}
				if l.err != nil {
					it.err = l.err
					return
				}
				got[slot] = l.c
			}
			for p := win.lo; p < win.hi; p++ {
				e := p
				if win.perm != nil {
					e = int64(win.perm[p])
				}
				slot := sort.Search(len(win.chunks), func(i int) bool { return win.off[i+1] > e })
				var s Sample
				if err := got[slot].sample(int(e-win.off[slot]), &s); err != nil {
					it.err = err
					return
				}
				select {
				case it.out <- s:
				case <-it.done:
					return
				}
			}
		}
	}()
	return it, nil
}

// Next advances to the next sample; it returns false at the end or on
// error (check Err).
func (it *Iterator) Next() bool {
	s, ok := <-it.out
	if !ok {
		return false
	}
	it.cur = s
	it.n++
	return true
}

// Sample returns the current sample. It is the caller's to keep.
func (it *Iterator) Sample() Sample { return it.cur }

// Err returns the error that ended the iteration, if any. Call it after
// Next returned false.
func (it *Iterator) Err() error { return it.err }

// Close stops the iteration and waits for its goroutines.
func (it *Iterator) Close() {
	it.once.Do(func() { close(it.done) })
	for range it.out {
	}
	it.wg.Wait()
}
