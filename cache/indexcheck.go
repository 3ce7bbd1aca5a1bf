package cache

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"

	badger "github.com/dgraph-io/badger/v4"
	"github.com/dgraph-io/badger/v4/pb"
	"github.com/dgraph-io/badger/v4/table"
	"github.com/dgraph-io/badger/v4/y"
	"google.golang.org/protobuf/proto"
)

// checkIndexTables checks the footer of every table Badger's MANIFEST
// lists in dir's index, before Badger opens them: Badger reads a table's
// footer in a goroutine of its own and panics on one that is truncated or
// overwritten (a slice out of range), which no caller can recover, so
// every command that opened the cache died with a stack trace and exit
// status 2. The check reads what Badger's own open reads first (the
// checksum and index lengths at the end of the file, and the index's
// checksum) and costs one small read per table. An index without a
// MANIFEST (a new cache) has nothing to check.
func checkIndexTables(dir string) error {
	idx := filepath.Join(dir, indexDir)
	mf, err := os.Open(filepath.Join(idx, badger.ManifestFilename))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return nil // Badger's open reports it
	}
	defer mf.Close()
	m, _, err := badger.ReplayManifestFile(mf, 0, badger.Options{})
	if err != nil {
		return nil // Badger's open reports a bad MANIFEST as an error
	}
	ids := make([]uint64, 0, len(m.Tables))
	for id := range m.Tables {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	for _, id := range ids {
		path := table.NewFilename(id, idx)
		if why := tableFooterProblem(path); why != "" {
			return fmt.Errorf("%w: index file %s is damaged (%s), so the index cannot be opened; the chunk files are intact, but the index is what says which samples they hold: restore %s/ from a copy, or move %s away and run the fill again", ErrCorrupt, path, why, idx, dir)
		}
	}
	return nil
}

// tableFooterProblem says what is wrong with the footer of the Badger
// table at path ("" when nothing is): its layout ends
// [index][index length u32][checksum][checksum length u32], and the
// checksum covers the index.
func tableFooterProblem(path string) string {
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return "missing"
	}
	if err != nil {
		return "" // Badger's open reports it
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	// Read only the end of the file: the footer and the index.
	n := fi.Size()
	at := func(off, size int64) []byte {
		b := make([]byte, size)
		f.ReadAt(b, off) // within the file: a read error leaves zeros, reported as damage
		return b
	}
	if n < 8 {
		return fmt.Sprintf("%d bytes, too short for a table", n)
	}
	cl := int64(binary.BigEndian.Uint32(at(n-4, 4)))
	if cl == 0 || cl > n-8 {
		return fmt.Sprintf("truncated or overwritten: its footer gives a %d-byte checksum in a %d-byte file", cl, n)
	}
	var sum pb.Checksum
	if err := proto.Unmarshal(at(n-4-cl, cl), &sum); err != nil || (sum.Algo != pb.Checksum_CRC32C && sum.Algo != pb.Checksum_XXHash64) {
		return "truncated or overwritten: its footer holds no valid checksum"
	}
	il := int64(binary.BigEndian.Uint32(at(n-8-cl, 4)))
	if il == 0 || il > n-8-cl {
		return fmt.Sprintf("truncated or overwritten: its footer gives a %d-byte index in a %d-byte file", il, n)
	}
	if y.VerifyChecksum(at(n-8-cl-il, il), &sum) != nil {
		return "its index does not match its checksum"
	}
	return ""
}
