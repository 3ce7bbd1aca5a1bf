package cache

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	badger "github.com/dgraph-io/badger/v4"

	"distill/internal/namelist"
)

// Index key layout (format).
const (
	keyManifest    = 'm' // "m" -> manifest JSON
	keyRangePrefix = 'r' // "r" + be64(start) -> ChunkInfo JSON
	keySamplePref  = 's' // "s" + be64(index) -> be64(chunk start) + be32(row)
)

// MaxChunkSamples bounds the samples of one chunk so that its index entries
// fit in one Badger transaction (atomic commit) under the memory cap.
const MaxChunkSamples = 16384

// Paths inside a cache directory (format).
const (
	lockName   = "LOCK"
	indexDir   = "index"
	chunksDir  = "chunks"
	tmpDir     = "tmp"
	ownerLock  = "owner.lock"
	chunkExt   = ".arrow"
	tmpFileExt = ".tmp"
)

func rangeKey(start int64) []byte {
	k := make([]byte, 9)
	k[0] = keyRangePrefix
	binary.BigEndian.PutUint64(k[1:], uint64(start))
	return k
}

func sampleKey(i int64) []byte {
	k := make([]byte, 9)
	k[0] = keySamplePref
	binary.BigEndian.PutUint64(k[1:], uint64(i))
	return k
}

func sampleValue(start int64, row uint32) []byte {
	v := make([]byte, 12)
	binary.BigEndian.PutUint64(v, uint64(start))
	binary.BigEndian.PutUint32(v[8:], row)
	return v
}

// chunkFileName is the name of the chunk covering r inside chunks/.
func chunkFileName(r Range) string {
	return fmt.Sprintf("%012d-%012d%s", r.Start, r.End, chunkExt)
}

// badgerOptions caps Badger's memory: one 16 MiB memtable arena (plus one
// being flushed), 8 MiB block cache, 8 MiB index cache, 2 MiB tables, so an
// open index stays under about 50 MiB of Go heap regardless of its size; the
// defaults (64 MiB x 5 memtables, 256 MiB block cache) would use ~600 MiB.
func badgerOptions(dir string, readOnly bool) badger.Options {
	o := badger.DefaultOptions(filepath.Join(dir, indexDir))
	o.Logger = nil
	o.MemTableSize = 16 << 20
	o.NumMemtables = 2
	o.BlockCacheSize = 8 << 20
	o.IndexCacheSize = 8 << 20
	o.BaseTableSize = 2 << 20
	o.ValueLogFileSize = 16 << 20
	o.NumCompactors = 2
	o.NumLevelZeroTables = 4
	o.SyncWrites = true
	o.ReadOnly = readOnly
	o.DetectConflicts = false
	return o
}

// dirLock is a held flock on DIR/LOCK. Writers hold it exclusively for the
// duration of one index update (a few milliseconds per commit); readers hold
// it shared while they load the manifest and range table. Nobody keeps the
// Badger index open longer than that, which is how a reader can open a cache
// while another process is filling it: Badger lets only one process open a
// directory read-write, and its read-only mode refuses a directory whose
// write-ahead log is live.
//
// Readers need only read permission: they open LOCK read-only (flock works
// on any open file). If LOCK does not exist and cannot be created (a
// read-only mount, a directory of another user), no writer has ever opened
// this copy of the cache, and the reader proceeds without a lock; it does
// the same where the file system has no flock (ENOLCK, EOPNOTSUPP). f is
// nil then.
type dirLock struct{ f *os.File }

// lockFreeReads counts reader sessions that ran without a lock (tests).
var lockFreeReads atomic.Int64

// testHookLockBusy, when set (tests), runs each time lockDir finds the
// lock held by someone else and is about to wait: a test learns that a
// writer is blocked on a lock it holds without guessing how long to wait.
var testHookLockBusy func(exclusive bool)

func lockDir(dir string, exclusive bool, timeout time.Duration) (*dirLock, error) {
	path := filepath.Join(dir, lockName)
	var f *os.File
	var err error
	if exclusive {
		f, err = os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o644)
	} else {
		f, err = os.Open(path)
		if errors.Is(err, os.ErrNotExist) {
			f, err = os.OpenFile(path, os.O_RDONLY|os.O_CREATE, 0o644)
			if isReadOnlyErr(err) {
				lockFreeReads.Add(1)
				return &dirLock{}, nil
			}
		}
	}
	if err != nil {
		return nil, fmt.Errorf("cache: %s: opening lock file: %w (readers need read permission on it, writers write permission)", dir, err)
	}
	how := syscall.LOCK_SH
	if exclusive {
		how = syscall.LOCK_EX
	}
	deadline := time.Now().Add(timeout)
	wait := time.Millisecond
	for {
		err = syscall.Flock(int(f.Fd()), how|syscall.LOCK_NB)
		if err == nil {
			return &dirLock{f: f}, nil
		}
		if !exclusive && (errors.Is(err, syscall.ENOLCK) || errors.Is(err, syscall.EOPNOTSUPP)) {
			f.Close()
			lockFreeReads.Add(1)
			return &dirLock{}, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) || time.Now().After(deadline) {
			f.Close()
			if errors.Is(err, syscall.EWOULDBLOCK) {
				// The holder is a fill, teacherd or reset of this cache:
				// stopped (SIGSTOP, a suspended job) or in a long commit. A
				// CLI user can find it; a caller of the API can also wait
				// longer (Options.LockTimeout).
				return nil, fmt.Errorf("%w: %s/%s held by another process for more than %v: a fill, teacherd or reset of this cache, stopped or in a long commit; let it finish, or stop it (lsof %s/%s names it), then run again (the API: Options.LockTimeout waits longer)",
					ErrLocked, dir, lockName, timeout, dir, lockName)
			}
			return nil, fmt.Errorf("cache: %s: flock: %w", dir, err)
		}
		if testHookLockBusy != nil {
			testHookLockBusy(exclusive)
		}
		time.Sleep(wait)
		wait = min(2*wait, 50*time.Millisecond)
	}
}

// isReadOnlyErr reports whether err says we may not create or change a
// file: a read-only file system or a permission refusal.
func isReadOnlyErr(err error) bool {
	return errors.Is(err, syscall.EROFS) || errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM)
}

// isFile reports whether path exists and is not a directory.
func isFile(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && !fi.IsDir()
}

func (l *dirLock) unlock() {
	if l.f != nil {
		l.f.Close() // closing the fd drops the flock
	}
}

// indexRecoveries counts read-write recoveries of crashed indexes (tests).
var indexRecoveries atomic.Int64

// indexSession is the index open under the directory lock.
type indexSession struct {
	lock  *dirLock
	db    *badger.DB
	dir   string
	write bool
}

// missingIndex is the error of opening dir, which has no index: a path
// that does not exist, a file, or a directory that is not a cache.
func missingIndex(dir string) error {
	fi, err := os.Stat(dir)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return fmt.Errorf("%w: %s does not exist (check the path; a fill creates the cache)", ErrNotCache, dir)
	case err == nil && !fi.IsDir():
		return fmt.Errorf("%w: %s is a file, not a cache directory (give the directory a fill wrote)", ErrNotCache, dir)
	}
	if err := lostIndex(dir); err != nil {
		return err
	}
	return fmt.Errorf("%w: %s has no %s/ (create the cache with a fill first)", ErrNotCache, dir, indexDir)
}

// lostIndex is ErrIndexLost's error for dir, which had no index/, when
// its chunks/ holds files; nil when it holds none. Chunk files are only
// ever published into chunks/ after index/ exists, so files there and no
// index/ after them (index/ is looked for again once chunks/ is listed)
// mean an index that was deleted or not copied with them, or a reset
// that stopped between removing the index and the chunk files: a fill
// into dir would create a new index, and its GC would remove every chunk
// file as unreferenced.
func lostIndex(dir string) error {
	ents, err := os.ReadDir(filepath.Join(dir, chunksDir))
	if err != nil || len(ents) == 0 {
		return nil
	}
	if _, err := os.Stat(filepath.Join(dir, indexDir)); err == nil {
		return nil // made meanwhile by a writer
	}
	files := make([]string, len(ents))
	for i, e := range ents {
		files[i] = e.Name()
	}
	return fmt.Errorf("%w: %s has no %s/, but %s/ holds %d files (%s): the index that recorded them is gone (deleted, or not copied with %s/), and a fill would discard them and compute them again; copy their %s/ back into %s, or run cachectl reset --cache %s --force to discard them",
		ErrIndexLost, dir, indexDir, chunksDir, len(ents), namelist.Head(files, 3), chunksDir, indexDir, dir, dir)
}

// statIndex checks that dir holds an index directory: nil, missingIndex's
// error, or the stat error (a permission refusal) naming dir. Every entry
// point that needs an existing cache (readers, Open, Repair, Reset) says
// so alike: they printed "stat DIR/index: not a directory" for a file.
func statIndex(dir string) error {
	_, err := os.Stat(filepath.Join(dir, indexDir))
	if errors.Is(err, os.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return missingIndex(dir)
	}
	if err != nil {
		return fmt.Errorf("cache: %s: %w", dir, err)
	}
	return nil
}

// openIndex takes the lock and opens Badger. A read-only open of an index
// whose last writer crashed fails with badger.ErrTruncateNeeded (its log
// has a torn tail); then we recover it once with a read-write open.
func openIndex(dir string, write bool, timeout time.Duration) (*indexSession, error) {
	if err := statIndex(dir); err != nil {
		// A writer creates the index of a new cache (Create); a reader,
		// or a path that is a file, has nothing to open.
		if !write || !errors.Is(err, ErrNotCache) || isFile(dir) {
			return nil, err
		}
	}
	if write {
		// Badger would create it 0700; 0755 less the umask lets other
		// users read the cache (shareIndex widens what Badger makes inside).
		if err := os.MkdirAll(filepath.Join(dir, indexDir), 0o755); err != nil {
			return nil, fmt.Errorf("cache: %s: %w", dir, err)
		}
	}
	for attempt := 0; ; attempt++ {
		l, err := lockDir(dir, write, timeout)
		if err != nil {
			return nil, err
		}
		if err := checkIndexTables(dir); err != nil {
			l.unlock()
			return nil, err
		}
		db, err := badger.Open(badgerOptions(dir, !write))
		if err == nil {
			return &indexSession{lock: l, db: db, dir: dir, write: write}, nil
		}
		debris := attempt < 2 && (isTruncateNeeded(err) || isEmptyLog(err) || hasEmptyLogs(dir))
		if debris && write {
			// Killed while Badger created a log file: it is empty (Badger
			// sizes a new file before writing it), holds no data, and
			// Badger refuses to reopen it. Remove it under the lock.
			if rerr := removeEmptyLogs(dir); rerr != nil {
				l.unlock()
				return nil, fmt.Errorf("cache: %s: opening index: %w (and removing empty logs failed: %v)", dir, err, rerr)
			}
		}
		l.unlock()
		if debris {
			indexRecoveries.Add(1)
			if !write {
				rw, rerr := openIndex(dir, true, timeout)
				if rerr != nil {
					return nil, fmt.Errorf("cache: %s: index needs recovery after a crashed writer, and recovering it failed: %w (open the cache once with write permission, e.g. cachectl status as its owner)", dir, rerr)
				}
				if rerr = rw.close(); rerr != nil {
					return nil, rerr
				}
			}
			continue
		}
		// Badger wraps without %w: the message decides too.
		if !write && (errors.Is(err, fs.ErrPermission) || strings.Contains(err.Error(), syscall.EACCES.Error())) {
			return nil, fmt.Errorf("cache: %s: opening index: %w (a reader needs read permission on %s/ and its files; a writer of this build widens them at its next commit, or run chmod -R a+rX %s)", dir, err, indexDir, dir)
		}
		return nil, fmt.Errorf("cache: %s: opening index: %w", dir, err)
	}
}

// isEmptyLog matches Badger's refusal to open an empty memtable or value
// log file (ristretto's z.NewFile, wrapped without %w).
func isEmptyLog(err error) bool { return strings.Contains(err.Error(), "Create a new file") }

// hasEmptyLogs reports whether the index holds 0-byte .mem or .vlog files,
// the debris of a writer killed while Badger created one. Badger's errors
// about them vary (a read-only open fails truncating one with EINVAL), so
// the files themselves decide, not the message.
func hasEmptyLogs(dir string) bool {
	ents, err := os.ReadDir(filepath.Join(dir, indexDir))
	if err != nil {
		return false
	}
	for _, e := range ents {
		if n := e.Name(); strings.HasSuffix(n, ".mem") || strings.HasSuffix(n, ".vlog") {
			if fi, err := e.Info(); err == nil && fi.Size() == 0 {
				return true
			}
		}
	}
	return false
}

func removeEmptyLogs(dir string) error {
	ents, err := os.ReadDir(filepath.Join(dir, indexDir))
	if err != nil {
		return err
	}
	for _, e := range ents {
		if n := e.Name(); strings.HasSuffix(n, ".mem") || strings.HasSuffix(n, ".vlog") {
			if fi, err := e.Info(); err == nil && fi.Size() == 0 {
				if err := os.Remove(filepath.Join(dir, indexDir, n)); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

// isTruncateNeeded matches badger.ErrTruncateNeeded, which Badger wraps
// without %w, so errors.Is alone does not see it.
func isTruncateNeeded(err error) bool {
	return errors.Is(err, badger.ErrTruncateNeeded) || strings.Contains(err.Error(), badger.ErrTruncateNeeded.Error())
}

func (s *indexSession) close() error {
	err := s.db.Close()
	if s.write {
		shareIndex(s.dir)
	}
	s.lock.unlock()
	if err != nil {
		return fmt.Errorf("cache: closing index: %w", err)
	}
	return nil
}

// shareIndex gives index/ and the files in it the permission bits of the
// cache directory itself, which Badger does not: it makes index/ 0700 and
// MANIFEST and KEYREGISTRY 0600, so another user could not read the cache.
// Bits are only added, never removed, so a private cache (DIR 0700) stays
// private; DIR's own mode went through the umask when it was made. Best
// effort: a writer that does not own a file (a group member) cannot chmod
// it, and readers then get a permission error naming the file.
func shareIndex(dir string) {
	st, err := os.Stat(dir)
	if err != nil {
		return
	}
	perm := st.Mode().Perm()
	widen := func(p string, want fs.FileMode) {
		if fi, err := os.Lstat(p); err == nil && fi.Mode().Perm()&want != want && fi.Mode()&fs.ModeSymlink == 0 {
			os.Chmod(p, fi.Mode().Perm()|want)
		}
	}
	idx := filepath.Join(dir, indexDir)
	widen(idx, perm)
	ents, err := os.ReadDir(idx)
	if err != nil {
		return
	}
	for _, e := range ents {
		if e.Type().IsRegular() {
			widen(filepath.Join(idx, e.Name()), perm&0o666)
		}
	}
}

// manifest reads the manifest record (ok=false if the index has none).
func (s *indexSession) manifest() (m Manifest, ok bool, err error) {
	err = s.db.View(func(txn *badger.Txn) error {
		it, err := txn.Get([]byte{keyManifest})
		if errors.Is(err, badger.ErrKeyNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		ok = true
		return it.Value(func(v []byte) error {
			m, err = unmarshalManifest(v)
			return err
		})
	})
	return m, ok, err
}

// ranges returns every committed chunk sorted by start.
func (s *indexSession) ranges() ([]ChunkInfo, error) {
	var out []ChunkInfo
	err := s.db.View(func(txn *badger.Txn) error {
		o := badger.DefaultIteratorOptions
		o.Prefix = []byte{keyRangePrefix}
		it := txn.NewIterator(o)
		defer it.Close()
		for it.Rewind(); it.Valid(); it.Next() {
			item := it.Item()
			k := item.Key()
			var ci ChunkInfo
			err := item.Value(func(v []byte) error { return json.Unmarshal(v, &ci) })
			if err != nil || len(k) != 9 || int64(binary.BigEndian.Uint64(k[1:])) != ci.Start || ci.End <= ci.Start {
				return fmt.Errorf("%w: index range record %x: %v (value does not match key)", ErrCorrupt, k, err)
			}
			out = append(out, ci)
		}
		return nil
	})
	sort.Slice(out, func(a, b int) bool { return out[a].Start < out[b].Start })
	return out, err
}

// findOverlap returns the index of the chunk in sorted rs that overlaps r,
// or -1.
func findOverlap(rs []ChunkInfo, r Range) int {
	i := sort.Search(len(rs), func(i int) bool { return rs[i].End > r.Start })
	if i < len(rs) && rs[i].Start < r.End {
		return i
	}
	return -1
}
