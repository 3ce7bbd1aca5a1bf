package cache

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// ResetReport says what Reset removed.
type ResetReport struct {
	// Manifest is the manifest the index held.
	Manifest Manifest
	// Chunks and Samples count the committed chunks discarded (only with
	// force; zero otherwise).
	Chunks, Samples int64
	// Files are the removed paths, relative to the cache directory.
	Files []string
	// IndexLost says the directory had chunk files but no index
	// (ErrIndexLost): Manifest is empty, and Files are what was removed.
	IndexLost bool
}

// Reset turns dir back into a directory that holds no cache: it removes
// the index (manifest included), every chunk file and the temporary files
// of dead writers, under the exclusive lock. It refuses, with an error
// wrapping ErrCommitted, a cache with committed chunks unless force is
// set, so committed data is never lost by accident; and it refuses, with
// ErrLocked, while a writer has the cache open (a fill or a teacherd). A
// crash during Reset leaves either the cache as it was or no index; in the
// latter case the chunk files left make the directory one whose index is
// lost (ErrIndexLost), which Create refuses and Reset with force empties.
//
// Reset leaves LOCK and the empty chunks/ and tmp/: a process that opened
// LOCK before Reset removed it would lock the removed file while the next
// one locks a new one, and a fill starting meanwhile has already made the
// two directories and publishes into them.
//
// A failed first fill does not need Reset (the next fill replaces the
// manifest of a cache with no committed chunk); Reset is for a directory
// that should stop being a cache, or be refilled from scratch.
func Reset(dir string, force bool, opts *Options) (ResetReport, error) {
	var rep ResetReport
	o := opts.withDefaults()
	fs := o.FS
	if err := statIndex(dir); err != nil {
		if errors.Is(err, ErrIndexLost) {
			return resetLost(dir, force, o, err)
		}
		return rep, fmt.Errorf("%w; nothing to reset", err)
	}
	s, err := openIndex(dir, true, o.LockTimeout)
	if err != nil {
		return rep, err
	}
	locked := true
	defer func() {
		if locked {
			s.close()
		}
	}()
	m, _, err := s.manifest()
	if err != nil {
		return rep, fmt.Errorf("%s: %w", dir, err)
	}
	rep.Manifest = m
	rs, err := s.ranges()
	if err != nil {
		return rep, fmt.Errorf("%s: %w", dir, err)
	}
	var samples, bytes int64
	for _, r := range rs {
		samples += r.Len()
		bytes += r.Bytes
	}
	// A live writer is checked first: refusing a cache in use because it
	// has committed chunks would send the user to --force, which then
	// refuses because of the writer.
	tmps, err := fs.ReadDir(filepath.Join(dir, tmpDir))
	if err != nil {
		return rep, fmt.Errorf("cache: reset: %w", err)
	}
	for _, n := range tmps {
		if !ownerDead(filepath.Join(dir, tmpDir, n)) {
			return rep, fmt.Errorf("%w: %s is in use by another process (a fill or teacherd writing to it holds %s/%s, named after its pid): stop that fill or teacherd first, then run reset again", ErrLocked, dir, tmpDir, n)
		}
	}
	if len(rs) > 0 && !force {
		return rep, fmt.Errorf("%w: %s holds %d committed chunks (%d samples, %d bytes) of dataset %s; reset refuses to discard them: fill another directory, or pass --force to delete them", ErrCommitted, dir, len(rs), samples, bytes, m.DatasetFingerprint)
	}
	// Close Badger but keep the directory lock until everything is gone.
	if err := s.db.Close(); err != nil {
		return rep, fmt.Errorf("cache: reset: closing index: %w", err)
	}
	defer s.lock.unlock()
	locked = false
	// One rename makes the directory stop being a cache; the rest is
	// cleanup that GC would also do.
	var id [6]byte
	rand.Read(id[:])
	grave := filepath.Join(dir, tmpDir, "reset-"+hex.EncodeToString(id[:])+tmpFileExt)
	if err := fs.Rename(filepath.Join(dir, indexDir), grave); err != nil {
		return rep, fmt.Errorf("cache: reset: moving %s/ away: %w", indexDir, err)
	}
	if err := fs.SyncDir(dir); err != nil {
		return rep, fmt.Errorf("cache: reset: %w", err)
	}
	rep.Files = append(rep.Files, indexDir+"/")
	if err := fs.RemoveAll(grave); err != nil {
		return rep, fmt.Errorf("cache: reset: %w", err)
	}
	rep.Chunks, rep.Samples = int64(len(rs)), samples
	err = removeChunksAndTmps(fs, dir, tmps, &rep)
	return rep, err
}

// resetLost is Reset of dir, whose chunks/ holds files but whose index is
// lost (lost is that error): refused without force, since nothing says
// what the files hold; with force, the second half of Reset, under the
// exclusive lock: the chunk files and the dead writers' temporary
// directories are removed, after a check that no writer has dir open and
// that none created an index meanwhile. A crash in the middle leaves
// fewer files and no index, and Reset with force again removes the rest.
func resetLost(dir string, force bool, o Options, lost error) (ResetReport, error) {
	rep := ResetReport{IndexLost: true}
	if !force {
		return rep, fmt.Errorf("%w; nothing was reset", lost)
	}
	fs := o.FS
	l, err := lockDir(dir, true, o.LockTimeout)
	if err != nil {
		return rep, err
	}
	defer l.unlock()
	if _, err := os.Stat(filepath.Join(dir, indexDir)); err == nil {
		return rep, fmt.Errorf("%w: %s has an %s/ again: a fill created the cache meanwhile; nothing was reset (run reset again to reset that cache)", ErrLocked, dir, indexDir)
	}
	tmps, err := fs.ReadDir(filepath.Join(dir, tmpDir))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return rep, fmt.Errorf("cache: reset: %w", err)
	}
	for _, n := range tmps {
		if !ownerDead(filepath.Join(dir, tmpDir, n)) {
			return rep, fmt.Errorf("%w: %s is in use by another process (a fill or teacherd writing to it holds %s/%s, named after its pid): stop that fill or teacherd first, then run reset again", ErrLocked, dir, tmpDir, n)
		}
	}
	err = removeChunksAndTmps(fs, dir, tmps, &rep)
	return rep, err
}

// removeChunksAndTmps is the end of a reset: every file of chunks/ and
// the temporary directories tmps (of dead writers) removed, each named in
// rep.Files as it goes.
func removeChunksAndTmps(fs FS, dir string, tmps []string, rep *ResetReport) error {
	names, err := fs.ReadDir(filepath.Join(dir, chunksDir))
	if err != nil {
		return fmt.Errorf("cache: reset: %w", err)
	}
	for _, n := range names {
		if err := fs.Remove(filepath.Join(dir, chunksDir, n)); err != nil {
			return fmt.Errorf("cache: reset: %w", err)
		}
		rep.Files = append(rep.Files, filepath.Join(chunksDir, n))
	}
	for _, n := range tmps {
		if err := fs.RemoveAll(filepath.Join(dir, tmpDir, n)); err != nil {
			return fmt.Errorf("cache: reset: %w", err)
		}
		rep.Files = append(rep.Files, filepath.Join(tmpDir, n))
	}
	return nil
}
