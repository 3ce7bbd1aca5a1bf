package serve

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	pb "distill/proto/distill/v1"
)

// DataRoots are the directories whose files a remote client may name as
// dataset sources (teacherd --data-root). A client names paths on the
// daemon's machine, so without this any file the daemon can read would
// be open to it. No roots means no dataset file at all.
//
// A path is allowed when it is absolute and resolves (symlinks and ".."
// followed, as the kernel does when the file is opened) to a regular file
// inside a root, itself resolved. Refusals do not tell a file outside the
// roots from a missing one; only a missing file whose nearest existing
// directory resolves inside a root is reported as not found. The roots
// must not be writable by untrusted users: one who could swap a symlink
// between the check and the open could point it outside.
type DataRoots struct {
	dirs []string // absolute, symlinks resolved
}

// NewDataRoots resolves dirs (each must be an existing directory); its
// errors begin with said, how the user gave them ("--data-root", or
// "config FILE: data_roots:": Sources.Said).
func NewDataRoots(dirs []string, said string) (*DataRoots, error) {
	r := &DataRoots{}
	for _, d := range dirs {
		if d == "" {
			return nil, configErrorf("%s: empty path", said)
		}
		abs, err := filepath.Abs(d)
		if err != nil {
			return nil, configErrorf("%s %s: %v", said, d, err)
		}
		real, err := filepath.EvalSymlinks(abs)
		if err != nil {
			return nil, configErrorf("%s %s: %v (give an existing directory)", said, d, unwrapPath(err))
		}
		st, err := os.Stat(real)
		if err != nil {
			return nil, configErrorf("%s %s: %v", said, d, err)
		}
		if !st.IsDir() {
			return nil, configErrorf("%s %s is not a directory: give the directory that holds the datasets", said, d)
		}
		r.dirs = append(r.dirs, real)
	}
	return r, nil
}

// Dirs returns the resolved roots.
func (r *DataRoots) Dirs() []string {
	if r == nil {
		return nil
	}
	return r.dirs
}

// inside reports whether the resolved path p is one of the roots or below one.
func (r *DataRoots) inside(p string) bool {
	for _, d := range r.dirs {
		if rel, err := filepath.Rel(d, p); err == nil && filepath.IsLocal(rel) {
			return true
		}
	}
	return false
}

// Confine returns a copy of spec whose source paths are allowed by the
// roots (cleaned, absolute), or a status error: InvalidArgument for a
// relative path or one that is not a regular file, NotFound for a missing
// file inside a root, PermissionDenied for everything else.
func (r *DataRoots) Confine(spec *pb.Dataset) (*pb.Dataset, error) {
	out := proto.Clone(spec).(*pb.Dataset)
	for i, s := range out.GetSources() {
		p, err := r.resolve(i, s.GetPath())
		if err != nil {
			return nil, err
		}
		s.Path = p
	}
	return out, nil
}

func (r *DataRoots) resolve(i int, path string) (string, error) {
	if r == nil || len(r.dirs) == 0 {
		return "", status.Errorf(codes.PermissionDenied,
			"dataset source %d: this daemon reads no dataset files: it was started without --data-root; restart it with --data-root DIR naming the directories clients may read", i)
	}
	roots := strings.Join(r.dirs, ", ")
	if !filepath.IsAbs(path) {
		return "", status.Errorf(codes.InvalidArgument,
			"dataset source %d: path %q is relative: give the absolute path as the daemon sees it, under its data roots (%s)", i, path, roots)
	}
	denied := status.Errorf(codes.PermissionDenied,
		"dataset source %d: %s is not readable through this daemon: it is outside the daemon's data roots (%s) or does not resolve to a file in them; put the dataset under a root (teacherd --data-root)", i, path, roots)
	abs := filepath.Clean(path)
	real, err := filepath.EvalSymlinks(abs)
	if err != nil {
		if r.missingInside(abs) {
			return "", status.Errorf(codes.NotFound, "dataset source %d: %s does not exist on the daemon's machine (paths are the daemon's, not the client's)", i, path)
		}
		return "", denied
	}
	if !r.inside(real) {
		return "", denied
	}
	st, err := os.Stat(real)
	if err != nil {
		return "", denied
	}
	if !st.Mode().IsRegular() {
		return "", status.Errorf(codes.InvalidArgument, "dataset source %d: %s is not a regular file: give a JSONL, CSV or Parquet file", i, path)
	}
	// abs has no ".." left, so opening it resolves exactly as real did.
	return abs, nil
}

// missingInside reports whether abs does not exist and its nearest
// existing ancestor resolves inside a root: only then may "not found" be
// said without telling anything about files outside the roots. A path
// that exists but does not resolve (a dangling symlink) is not missing.
func (r *DataRoots) missingInside(abs string) bool {
	p := abs
	for {
		_, err := os.Lstat(p)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return false
		}
		parent := filepath.Dir(p)
		if parent == p {
			return false
		}
		p = parent
	}
	if p == abs {
		return false
	}
	real, err := filepath.EvalSymlinks(p)
	return err == nil && r.inside(real)
}
