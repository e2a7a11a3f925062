// doctor: filled in below
